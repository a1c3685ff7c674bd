"""Pipeline parallelism with schedules as data.

Status: skeleton. Nothing is exported yet; issue 8: schedules, `GPipe`,
`PipeDream`, `Interleaved1F1B`, `partition` land here.
"""

__all__: list[str] = []
