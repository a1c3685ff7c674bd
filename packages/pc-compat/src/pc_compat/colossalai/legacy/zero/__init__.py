"""``colossalai.legacy.zero``."""
