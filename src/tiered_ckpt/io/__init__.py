"""tiered_ckpt.io."""
