# Colossal-AI docs/source/en/basics/launch_colossalai.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: the Slurm block (md lines 193-200),
# by the import rule (colossalai -> pc_compat.colossalai). Other changes:
# - added (assembly): `args` with host and port set in code (the doc takes them
#   from colossalai.get_default_parser(), which Colossal-AI 0.5.0 does not have),
#   and the variables srun would set (SLURM_PROCID, SLURM_NPROCS) from torchrun's.
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
import argparse
import os

from pc_compat import colossalai

args = argparse.Namespace(host="127.0.0.1", port=int(os.environ["MASTER_PORT"]))
os.environ.setdefault("SLURM_PROCID", os.environ["RANK"])
os.environ.setdefault("SLURM_NPROCS", os.environ["WORLD_SIZE"])

colossalai.launch_from_slurm(host=args.host, port=args.port)
