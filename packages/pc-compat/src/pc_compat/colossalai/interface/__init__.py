"""``colossalai.interface``: ``ModelWrapper`` and ``OptimizerWrapper``."""

from __future__ import annotations

from typing import Any

from torch import nn

from pc_booster.wrappers import BoostedOptimizer

__all__ = ["ModelWrapper", "OptimizerWrapper"]

# What Booster.boost returns for the optimizer: unwrap(), backward(loss),
# clip_grad_by_norm(max_norm), step(), zero_grad() over the plugin's one.
OptimizerWrapper = BoostedOptimizer


class ModelWrapper(nn.Module):
    """What Colossal-AI's ``Booster.boost`` returns for the model: a module
    whose ``module`` is the plugin's model (a DDP or FSDP2 module, or the
    model itself), ``forward`` runs it, and ``unwrap()`` gives the model as
    the user built it (tensor-parallel layers stay split, FSDP2 parameters
    stay DTensors). As in Colossal-AI, ``state_dict()`` keys carry the
    ``module.`` prefix; ``booster.save_model`` writes the model's own keys."""

    def __init__(self, module: nn.Module, unwrapped: nn.Module | None = None) -> None:
        super().__init__()
        # The plugin's model (a registered submodule: parameters, train/eval).
        self.module = module
        # The model as built; not registered, so its parameters are not
        # listed twice.
        self.__dict__["_built"] = unwrapped if unwrapped is not None else module

    def unwrap(self) -> nn.Module:
        built: nn.Module = self.__dict__["_built"]
        return built

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)
