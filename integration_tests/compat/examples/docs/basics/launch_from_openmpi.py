# Colossal-AI docs/source/en/basics/launch_colossalai.md at
# 4f9953be335ef371b3848719ddafe596c01ecd37: the OpenMPI block (md lines 215-220),
# by the import rule (colossalai -> pc_compat.colossalai). Other changes:
# - added (assembly): `import colossalai` (the block has none); `args` with host
#   and port set in code (the doc takes them from colossalai.get_default_parser(),
#   which Colossal-AI 0.5.0 does not have); the variables mpirun would set
#   (OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE) from torchrun's.
# Layout: ruff format (quotes, line breaks).
# mypy: ignore-errors
import argparse
import os

from pc_compat import colossalai

args = argparse.Namespace(host="127.0.0.1", port=int(os.environ["MASTER_PORT"]))
os.environ.setdefault("OMPI_COMM_WORLD_RANK", os.environ["RANK"])
os.environ.setdefault("OMPI_COMM_WORLD_SIZE", os.environ["WORLD_SIZE"])
os.environ.setdefault("OMPI_COMM_WORLD_LOCAL_RANK", os.environ["LOCAL_RANK"])
os.environ.setdefault("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ["LOCAL_WORLD_SIZE"])

colossalai.launch_from_openmpi(host=args.host, port=args.port)
