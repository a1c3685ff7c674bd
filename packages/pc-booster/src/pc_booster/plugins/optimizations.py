"""The model-level switches the plugins' options offer, applied to the
model in place: ``enable_flash_attention``, ``enable_fused_normalization``,
``enable_all_optimization`` (some plugins), and every plugin's per-block
``compile`` and ``activation_checkpointing``.

[Note: per-block compile and recomputation]
Before a plugin wraps the model, each transformer block (the classes in a
transformers model's ``_no_split_modules``) gets, as torchtitan applies
them:

- recomputation through torch's composable ``checkpoint(block)`` (forward
  hooks: the block and the model keep their classes, names and state-dict
  keys). ``"full"`` saves the block's input only; ``"selective"`` saves
  the outputs of matrix products and attention (the costly operations)
  and recomputes the pointwise ones (norms, activations, rotary), through
  ``create_selective_checkpoint_contexts``. ``activation_checkpointing_fraction``
  picks the first share of the blocks;
- ``block.compile(backend=compile_backend)``: torch's own in-place compile
  of the module's call, hooks included (the sharding plugins' gathers
  break the graph where dynamo cannot follow them; torch's DDP-optimizer
  graph splitting is turned off for TorchDDPPlugin, where it fails on
  selective recomputation and each block is its own graph anyway). A
  recomputed block's children are compiled instead of the block: the
  checkpoint's hooks would run inside the compiled call, which inductor
  recomputes with other saved tensors than it saved.

Recomputing a block replays its forward, so it must not change state
between the two runs: a transformers model's key/value cache does. While
training, the model is called with ``use_cache=False`` (a forward
pre-hook), as transformers' own ``gradient_checkpointing_enable`` does.
Values are unchanged: recomputation and compilation of fp32 blocks give
the same losses and gradients as eager training, which the tests check
against a single process with the same options.
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch import nn

__all__ = ["apply_block_options", "apply_optimizations", "transformer_blocks"]

# Operations whose outputs selective recomputation keeps: matrix products
# and attention; everything else in a block is recomputed.
_SAVED = (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_cudnn_attention",
)  # fmt: skip


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer blocks, in order: modules of the classes its
    ``_no_split_modules`` names (transformers models); ValueError if none."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [m for m in model.modules() if type(m).__name__ in classes]
    if not blocks:
        raise ValueError(
            f"compile / activation_checkpointing apply to each transformer block, and "
            f"{type(model).__name__} names none (no _no_split_modules: not a transformers "
            "model). Compile or checkpoint your own blocks before boost (block.compile(), "
            "torch.utils.checkpoint), or drop the options."
        )
    return blocks


def _selective_context() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = {getattr(torch.ops.aten, n).default for n in _SAVED if hasattr(torch.ops.aten, n)}

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)  # type: ignore[no-untyped-call]


def _no_cache(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
    if module.training:
        kwargs["use_cache"] = False
    return args, kwargs


# The models whose training calls already pass use_cache=False (a registry,
# not an attribute written on the user's model).
_NO_CACHE: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _checkpointed(block: nn.Module) -> bool:
    """Whether torch's composable ``checkpoint`` is on ``block`` already
    (boosting a model again, after a refusal or in another booster): torch
    refuses to apply it twice, and once is what is asked."""
    from torch.distributed._composable.contract import _get_registry

    return "checkpoint" in (_get_registry(block) or {})


def apply_block_options(model: nn.Module, options: Any, *, torch_ddp: bool = False) -> None:
    """Every plugin's ``compile`` / ``activation_checkpointing`` on
    ``model``'s blocks [Note: per-block compile and recomputation]."""
    if not options.changes_blocks():
        return
    from torch.distributed._composable.checkpoint_activation import checkpoint

    blocks = transformer_blocks(model)
    recompute = options.activation_checkpointing
    # The first share of the blocks, at least one (0.28 of 25 blocks: 7).
    count = max(1, math.floor(options.activation_checkpointing_fraction * len(blocks) + 1e-9))
    for index, block in enumerate(blocks):
        recomputed = recompute != "none" and index < count
        if recomputed and not _checkpointed(block):  # a second boost of the same model
            extra = {"context_fn": _selective_context} if recompute == "selective" else {}
            checkpoint(block, **extra)
        if options.compile:
            # A compiled call runs the module's hooks inside the graph, and
            # dynamo does not follow the checkpoint's: a recomputed block's
            # children are compiled instead, the checkpoint staying eager.
            for target in block.children() if recomputed else (block,):
                target.compile(backend=options.compile_backend)
    if getattr(getattr(model, "config", None), "use_cache", False) and model not in _NO_CACHE:
        model.register_forward_pre_hook(_no_cache, with_kwargs=True)
        _NO_CACHE.add(model)
    if options.compile and torch_ddp:
        import torch._dynamo

        torch._dynamo.config.optimize_ddp = False


def apply_optimizations(model: nn.Module, options: Any) -> None:
    """``enable_flash_attention`` / ``enable_fused_normalization`` /
    ``enable_all_optimization`` of a plugin's ``options`` on ``model``, in
    place."""
    if options.flash_attention():
        setter = getattr(model, "set_attn_implementation", None)
        if setter is None:
            raise ValueError(
                f"enable_flash_attention: {type(model).__name__} is not a transformers model "
                "whose attention pc can switch to scaled_dot_product_attention."
            )
        setter("sdpa")
    if options.fused_normalization():
        # Every path to a norm, so that one shared by two parents is
        # replaced by one FusedRMSNorm in both.
        fused: dict[int, FusedRMSNorm] = {}
        for name, module in list(model.named_modules(remove_duplicate=False)):
            if not type(module).__name__.endswith("RMSNorm") or isinstance(
                module, nn.RMSNorm | FusedRMSNorm
            ):
                continue
            eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
            weight = getattr(module, "weight", None)
            if eps is None or not isinstance(weight, nn.Parameter) or not name:
                continue
            if id(module) not in fused:
                fused[id(module)] = FusedRMSNorm(weight, float(eps), type(module).__name__)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, fused[id(module)])


class FusedRMSNorm(nn.Module):
    """transformers' RMS norm (in fp32, scaled by the weight in the input's
    dtype) through torch's fused kernel: what ``enable_fused_normalization``
    puts in place of a model's own RMS norm, as Colossal-AI's does. It holds
    the same weight parameter under the same name, so the state dict's keys
    and the optimizer's parameters are unchanged; a module pc owns, not a
    reassigned ``forward`` [Note: forward hooks, not forward assignment in
    pc_tensor.hooks]."""

    def __init__(self, weight: nn.Parameter, eps: float, replaces: str = "RMSNorm") -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = self.eps = eps
        self.replaces = replaces

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        normed = torch.nn.functional.rms_norm(
            hidden.float(), (hidden.shape[-1],), eps=self.variance_epsilon
        )
        return self.weight * normed.to(hidden.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, replaces {self.replaces}"
