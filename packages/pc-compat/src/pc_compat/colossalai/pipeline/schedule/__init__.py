"""``colossalai.pipeline.schedule``."""
