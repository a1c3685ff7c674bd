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

import importlib.util
import logging

# [Note: torchao's import-time warnings] transformers imports torchao when
# it is installed (pc-offload's 8-bit optimizer states use it), and
# importing torchao logs warnings about its own set-up (each CUDA kernel
# library a CPU-only torch cannot load; torch's deprecation of how it
# registers two enums): four lines on stderr in every process, before
# pc-train's one-line messages. pc-train imports it first, and transformers'
# models that import more of it, with those two loggers quieted, so only
# the import is silent; torchao's later warnings show as usual.
if importlib.util.find_spec("torchao") is not None:
    _quieted = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    _levels = [logger.level for logger in _quieted]
    for _logger in _quieted:
        _logger.setLevel(logging.ERROR)
    try:  # torchao, and what transformers' models import of it
        import torchao  # noqa: F401
        import transformers.modeling_utils  # noqa: F401
    except Exception:  # a broken torchao is transformers' to report, as before
        pass
    finally:
        for _logger, _level in zip(_quieted, _levels, strict=True):
            _logger.setLevel(_level)

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
