"""ZeRO-1/2/3, FSDP and chunk-based ZeRO-3 (Gemini).

Status: skeleton. Nothing is exported yet; issues 6 and 7:
`LowLevelZeroOptimizer`, `FullyShardedDataParallel`, `GeminiDDP` land here.
"""

__all__: list[str] = []
