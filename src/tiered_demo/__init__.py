"""tiered_demo."""
