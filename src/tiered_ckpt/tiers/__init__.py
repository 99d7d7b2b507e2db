"""tiered_ckpt.tiers."""
