"""The pipeline front's options, parsed once at the user-facing edge.

[Note: gradient scale]
``forward_backward`` back-propagates each microbatch's loss as the
criterion returns it, so the gradients are the SUM over microbatches, as
haiscale's pipelines do: a haiscale program divides each microbatch's loss
by ``chunks`` itself (or accepts the sum). ``scale_grads=True`` divides each
microbatch's loss by the number of microbatches before backward, as
``torch.distributed.pipelining``'s schedules do, so a criterion returning a
microbatch's mean loss gives the gradient of the whole batch's mean loss
(the convention pc-booster's pipelines keep, docs/packages/pc-pipeline.md). The losses
returned are always the criterion's own values, unscaled.
"""

from __future__ import annotations

import enum

__all__ = ["CheckpointMode", "parse_checkpoint"]


class CheckpointMode(enum.Enum):
    """Which microbatches recompute their stage's activations in backward
    (torchgpipe's and haiscale's values)."""

    ALWAYS = "always"  # every microbatch
    EXCEPT_LAST = "except_last"  # every microbatch but the last (its backward comes first)
    NEVER = "never"

    def applies(self, microbatch: int, num_microbatches: int) -> bool:
        """Whether ``microbatch`` (0-based) runs under activation checkpointing."""
        if self is CheckpointMode.ALWAYS:
            return True
        if self is CheckpointMode.EXCEPT_LAST:
            return microbatch < num_microbatches - 1
        return False


def parse_checkpoint(value: bool | str | CheckpointMode) -> CheckpointMode:
    """``checkpoint=`` as users pass it: haiscale's strings, pc's booleans
    (True is ``"always"``) or a :class:`CheckpointMode`."""
    if isinstance(value, CheckpointMode):
        return value
    if isinstance(value, bool):
        return CheckpointMode.ALWAYS if value else CheckpointMode.NEVER
    if isinstance(value, str):
        for mode in CheckpointMode:
            if value == mode.value:
                return mode
    raise ValueError(
        f"checkpoint must be one of 'always', 'except_last', 'never' (or True / False), "
        f"got {value!r}."
    )
