"""``colossalai.legacy``: the parts of Colossal-AI's legacy tree that pc
mirrors (``colossalai.legacy.zero.gemini.ColoInitContext``)."""
