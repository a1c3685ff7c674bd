"""pc-train: the application on top of pc-booster.

The ``pc-train`` command (:mod:`pc_train.train`: a ``transformers`` causal
LM under any plugin, configs, resume, reports and plots) and
``pc-estimate`` (:mod:`pc_train.estimate`: per-rank memory and step time
of each plugin, and the one to use). The library they drive, ``Booster``
and its plugins, is pc-booster.
"""

import os

# [Note: torch's C++ warnings] When the rank serving the job's store dies,
# torch logs each failed store call with about 30 lines of C++ stack before
# the Python error pc-train turns into one line. Its C++ log level is read
# once, when torch loads: set here, before pc-train imports torch, unless
# the user chose one (TORCH_CPP_LOG_LEVEL=WARNING shows them again).
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")

from pc_train.data import load_byte_corpus

# Through pc_train.estimate (the command line, which re-exports the cost
# model's names): importing the submodule binds ``pc_train.estimate`` to
# it, and this import then rebinds that name to the function, so it stays
# the function whatever is imported later.
from pc_train.estimate import estimate, recommend
from pc_train.train_config import TrainConfig


def __getattr__(name: str) -> object:
    # Imported on use, so `python -m pc_train.train` does not find the
    # module already loaded by the package.
    if name == "train":
        from pc_train.train import train

        return train
    raise AttributeError(f"module 'pc_train' has no attribute {name!r}")


__all__ = [
    "TrainConfig",
    "estimate",
    "load_byte_corpus",
    "recommend",
    "train",
]
