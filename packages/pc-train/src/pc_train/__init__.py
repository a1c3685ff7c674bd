"""pc-train: the application on top of pc-booster.

The ``pc-train`` command (:mod:`pc_train.train`: a ``transformers`` causal
LM under any plugin, configs, resume, reports and plots) and
``pc-estimate`` (:mod:`pc_train.estimate`: per-rank memory and step time
of each plugin, and the one to use). The library they drive, ``Booster``
and its plugins, is pc-booster.
"""

from pc_train.data import load_byte_corpus
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
