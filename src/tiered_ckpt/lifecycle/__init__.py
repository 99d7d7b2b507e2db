"""tiered_ckpt.lifecycle."""
