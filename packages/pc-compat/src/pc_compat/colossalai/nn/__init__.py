"""``colossalai.nn``."""
