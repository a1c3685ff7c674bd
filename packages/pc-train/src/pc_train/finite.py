"""``--check-finite``: what stops a run whose loss or gradients are not
finite, with the step, the ranks and the last checkpoint named, and the
clip pc-train gives a plugin so that its global gradient norm is checked
even where the run does not clip."""

from __future__ import annotations

from pc_booster import NonFiniteGradientError
from pc_train.options import PluginOptions
from pc_train.train_config import TrainConfig

__all__ = [
    "NonFiniteLossError",
    "non_finite_gradient",
    "non_finite_loss",
    "periodic",
    "plugin_max_norm",
]


class NonFiniteLossError(ValueError):
    """The loss, or the gradients' global norm, became inf or NaN
    (``--check-finite``)."""


def periodic(config: TrainConfig, step: int) -> bool:
    """Whether step ``step`` saves a checkpoint (``--checkpoint-every``)."""
    return bool(config.checkpoint_every) and step % config.checkpoint_every == 0


# A clip no gradient reaches: it clips nothing, but has the plugin compute
# (and check) the global norm.
_NEVER_CLIPS = 1e30


def plugin_max_norm(config: TrainConfig, options: PluginOptions) -> float:
    """The plugin's clip: ``--clip-norm``; without clipping but with
    ``--check-finite``, one no gradient reaches (1e30), which clips nothing
    but has every plugin compute the global gradient norm and refuse the
    step when it is not finite (Gemini stepping in backward has no global
    norm: its loss is checked alone)."""
    if config.clip_norm > 0 or not config.check_finite or options.step_in_backward:
        return config.clip_norm
    return _NEVER_CLIPS


def _last_saved(config: TrainConfig, start: int, step: int) -> str:
    saved = max((s for s in range(start, step + 1) if periodic(config, s)), default=0)
    return f"the last checkpoint is at step {saved}" if saved else "no checkpoint yet"


def non_finite_loss(
    config: TrainConfig, start: int, step: int, bad: list[int], in_backward: bool
) -> NonFiniteLossError:
    """The error of a step (``step`` + 1) whose loss is not finite on the
    ranks ``bad``."""
    when = (
        "stopped after the step (--step-in-backward steps inside backward; the "
        "weights in memory are not to be trusted, the checkpoints are)"
        if in_backward
        else "stopped before the optimizer step"
    )
    return NonFiniteLossError(
        f"step {step + 1}: the loss (or gradient norm) is not finite on rank(s) "
        f"{', '.join(map(str, bad))}; {when} (--check-finite), "
        f"{_last_saved(config, start, step)}. Lower --lr, use bf16 rather than fp16, or "
        "--resume from an earlier checkpoint."
    )


def non_finite_gradient(
    config: TrainConfig, start: int, step: int, error: NonFiniteGradientError
) -> NonFiniteLossError:
    """The error of a step (``step`` + 1) whose loss is finite but whose
    gradients' global norm is not."""
    return NonFiniteLossError(
        f"step {step + 1}: the loss is finite but the gradients' global norm is "
        f"{error.norm}; stopped before the optimizer step, the weights unchanged "
        f"(pc never clips by a non-finite norm), {_last_saved(config, start, step)}. Lower "
        "--lr, check the data, use fp32 rather than bf16, or --resume from an earlier "
        "checkpoint."
    )
