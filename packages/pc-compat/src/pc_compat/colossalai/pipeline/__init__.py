"""``colossalai.pipeline``."""
