"""What :func:`~pc_tensor.shard_model` runs around a model's own code:
under sequence parallelism, the hooks that split the hidden states along
the sequence before the first block, gather them after the last and before
the modules that read the sequence whole; the gradient hook that sums a
partial gradient over the group; and the hooks that compute the loss from
vocabulary-sharded logits."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pc_tensor.comm import gather_from_tp, split_to_tp
from pc_tensor.layers import vocab_parallel_cross_entropy

__all__ = [
    "ForwardHooks",
    "VocabParallelLoss",
    "gather_output",
    "input_hook",
    "split_sequence",
    "sum_over_group",
]


def _hidden_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor | None, bool]:
    """The hidden states a block or module was called with, and whether they
    came as a keyword."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0], False
    value = kwargs.get("hidden_states")
    return (value, True) if isinstance(value, torch.Tensor) else (None, False)


def _replace_hidden(
    args: tuple[Any, ...], kwargs: dict[str, Any], keyword: bool, value: torch.Tensor
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if keyword:
        kwargs = {**kwargs, "hidden_states": value}
        return args, kwargs
    return (value, *args[1:]), kwargs


def input_hook(
    transform: Any,
) -> Any:
    def hook(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        hidden, keyword = _hidden_arg(args, kwargs)
        if hidden is None:
            raise TypeError(
                f"sequence parallelism: {type(module).__name__} was called without a "
                "hidden_states tensor as its first argument or keyword."
            )
        return _replace_hidden(args, kwargs, keyword, transform(hidden))

    return hook


def split_sequence(group: dist.ProcessGroup, hidden: torch.Tensor) -> torch.Tensor:
    world = dist.get_world_size(group)
    if hidden.dim() < 2 or hidden.shape[1] % world:
        raise ValueError(
            f"sequence parallelism splits the sequence (dim 1) over {world} ranks, but the "
            f"hidden states have shape {tuple(hidden.shape)}; pad the sequence length to a "
            f"multiple of {world} (or shard with sequence_parallel=False)."
        )
    return split_to_tp(hidden, group, dim=1)


def gather_output(group: dist.ProcessGroup, module: nn.Module, args: Any, output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return gather_from_tp(output, group, dim=1)
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (gather_from_tp(output[0], group, dim=1), *output[1:])
    raise TypeError(
        f"sequence parallelism: the last block ({type(module).__name__}) returned "
        f"{type(output).__name__}; expected a tensor or a tuple starting with one."
    )


def sum_over_group(group: dist.ProcessGroup, grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad


class ForwardHooks:
    """A change to a model's forward made with torch's module hooks, never by
    assigning the instance's ``forward`` [Note: forward hooks, not forward
    assignment]: ``before(module, args, kwargs)`` returns the arguments the
    model's own forward gets and what ``after(module, output, kept)`` needs
    of them; ``after`` returns the output the caller gets.

    Hooks registered later wrap those registered earlier, as nested wrappers
    would: the pre-hook is prepended (the outer change rewrites the
    arguments first), the post-hook appended (it sees the inner change's
    output). The post-hook is always called, even when the forward raises,
    so what ``before`` kept never outlives the call."""

    def __init__(self, model: nn.Module, before: Any, after: Any) -> None:
        self.before, self.after = before, after
        self._kept: list[Any] = []
        self.handles = (
            model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True),
            model.register_forward_hook(self._post, always_call=True),
        )

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        args, kwargs, kept = self.before(module, args, kwargs)
        self._kept.append(kept)
        return args, kwargs

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not self._kept:  # an earlier pre-hook raised before ours ran
            return None
        kept = self._kept.pop()
        if output is None:  # the forward raised: torch re-raises, the output unused
            return None
        return self.after(module, output, kept)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


# [Note: forward hooks, not forward assignment]
# pc changes what a user's model does only through torch's module hooks,
# parametrisations, modules pc owns, or transformers' public API; it never
# assigns an instance's ``forward`` nor writes a private attribute of a
# user's module or config (integration_tests/test_no_forward_assignment.py
# reads the source for both). A hook pair keeps the model's class, its
# ``forward`` and its ``__call__`` what the user built, composes with other
# hooks (FSDP's, DDP's, compile's), and is removed by its handles.


class VocabParallelLoss:
    """The loss of a model whose LM head is vocabulary-sharded, as
    :class:`ForwardHooks`: ``before`` takes the labels from the call (the
    model's own forward would compute the loss over the full vocabulary it
    no longer has, some inline, some through ``loss_function``), and
    ``after`` computes it from the sharded logits, as ``transformers``
    defines it: next-token (labels shifted by one) for causal models,
    position-wise for masked ones; ``-100`` ignored; ``num_items_in_batch``
    and ``shift_labels`` honoured. A mixture-of-experts model's auxiliary
    loss (``aux_loss`` in its output, computed from the router logits
    without the labels) is added with the model's coefficient, as its own
    forward adds it to the loss."""

    def __init__(self, group: dist.ProcessGroup, causal: bool) -> None:
        self.group, self.causal = group, causal

    def hook(self, model: nn.Module) -> ForwardHooks:
        return ForwardHooks(model, self.before, self.after)

    def before(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], tuple[Any, Any, Any]]:
        kwargs = dict(kwargs)
        labels = kwargs.pop("labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        return args, kwargs, (labels, num_items, shift_labels)

    def after(self, module: nn.Module, out: Any, kept: tuple[Any, Any, Any]) -> Any:
        labels, num_items, shift_labels = kept
        if shift_labels is not None:
            target = shift_labels
        elif labels is None:
            return out
        elif self.causal:
            target = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        else:
            target = labels
        logits = out["logits"] if isinstance(out, dict) else out[0]
        loss = vocab_parallel_cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]),
            target.to(logits.device).reshape(-1),
            self.group,
            num_items=num_items,
        )
        aux = out.get("aux_loss") if isinstance(out, dict) else None
        if aux is not None:
            loss = loss + aux_loss_coefficient(module) * aux.to(loss.device)
        if isinstance(out, tuple):
            return (loss, *out)
        return type(out)(loss=loss, **{k: v for k, v in out.items() if k != "loss"})


def aux_loss_coefficient(model: nn.Module) -> float:
    """The weight a model gives its auxiliary loss (transformers' MoE models
    keep it as ``router_aux_loss_coef``, a few as ``aux_loss_coef``)."""
    config = getattr(model, "config", None)
    for owner, name in (
        (model, "router_aux_loss_coef"),
        (model, "aux_loss_coef"),
        (config, "router_aux_loss_coef"),
    ):
        value = getattr(owner, name, None)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    raise ValueError(
        f"{type(model).__name__} returns an aux_loss but pc finds no coefficient for it "
        "(router_aux_loss_coef or aux_loss_coef on the model or its config), so the "
        "vocabulary-parallel loss cannot add it as the model would; set "
        "config.output_router_logits = False to train without it."
    )
