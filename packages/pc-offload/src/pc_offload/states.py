"""Adam's moments kept in fp32, bf16 or 8 bits.

[Note: low-precision optimizer states]
The moments are *stored* in the chosen format and *computed* in fp32: each
step takes a tensor's moments a block at a time (``_BLOCK`` elements,
a bounded fp32 scratch), widens them to fp32, runs the same fused Adam
kernel as fp32 training on the fp32 master, gradient and widened moments,
and narrows the new moments back into storage. The parameter update of a
step therefore uses this step's fp32 moments, as torchao's low-bit Adams
do; only what is carried to the next step is rounded.

- ``bf16``: moments in bfloat16, rounded to nearest. 2 + 2 bytes per
  parameter instead of 4 + 4.
- ``int8``: torchao's 8-bit scheme, the one bitsandbytes introduced: blocks
  of 256 values scaled by their largest magnitude, each value coded as the
  nearest of 256 levels of a dynamic (non-linear) map, signed for the first
  moment and unsigned for the second. The codes and scales are torchao's
  ``OptimState8bit``; its quantise and dequantise functions do the work.
  torchao's own ``AdamW8bit`` runs its step through ``torch.compile`` (a C++
  toolchain and seconds of compilation per shape on a CPU); this step is
  eager torch over fp32 blocks, so what pc writes is the blocking and the
  step around torchao's format, not the format. A tensor of fewer than 4096
  elements, or not a whole number of blocks, keeps fp32 moments, as torchao
  and bitsandbytes do. About 1 + 1/64 bytes per moment value.

Masters stay fp32, unless the optimizer was asked for
``bf16_stochastic_round``: then a bf16 parameter is its own master (or has
a bf16 one on the host), stepped through the same fp32 blocks and written
back with stochastic rounding (:func:`round_stochastic_`: a value between
two bf16 neighbours becomes the upper one with the probability of its
distance from the lower, so updates smaller than bf16's spacing survive
on average instead of being rounded away). This is torchao's
``bf16_stochastic_round`` option on the device, here on the host. 2
bytes per parameter for the master instead of 4. The random bits are drawn
from a generator seeded by the step and the tensor's position, so a
resumed run rounds as the uninterrupted one did.

A checkpoint holds the moments in fp32 whatever the
storage (``state_dict`` widens them) and each group's ``state_dtype``;
loading narrows them into this optimizer's format, so a checkpoint written
with one format loads into another.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = [
    "StateDtype",
    "is_narrow",
    "moment_bytes",
    "parse_state_dtype",
    "round_stochastic_",
    "stored_bytes",
    "widen",
]

_BLOCK = 1 << 18  # elements widened at a time: 1 MiB of fp32 per moment
_QUANT_BLOCK = 256  # torchao's (and bitsandbytes') 8-bit block
_QUANT_MIN = 4096  # smaller tensors keep fp32 moments, as torchao does


class StateDtype(enum.Enum):
    """How Adam's moments are stored [Note: low-precision optimizer states]."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"


_NAMES = {
    "fp32": StateDtype.FP32,
    "float32": StateDtype.FP32,
    "bf16": StateDtype.BF16,
    "bfloat16": StateDtype.BF16,
    "int8": StateDtype.INT8,
    "8bit": StateDtype.INT8,
}


def parse_state_dtype(value: str | torch.dtype | StateDtype) -> StateDtype:
    """``"fp32"``, ``"bf16"``, ``"int8"`` (or ``torch.float32`` /
    ``torch.bfloat16``, or a :class:`StateDtype`)."""
    if isinstance(value, StateDtype):
        return value
    if value == torch.float32:
        return StateDtype.FP32
    if value == torch.bfloat16:
        return StateDtype.BF16
    if isinstance(value, str) and value.lower() in _NAMES:
        return _NAMES[value.lower()]
    raise ValueError(
        f"optimizer state dtype: expected one of 'fp32', 'bf16', 'int8' (or torch.float32, "
        f"torch.bfloat16), got {value!r}."
    )


def _torchao_8bit() -> Any:
    try:
        from torchao.optim.subclass_8bit import OptimState8bit
    except ImportError as error:
        raise ImportError(
            "8-bit optimizer states use torchao's format (OptimState8bit): install torchao "
            "(`pip install torchao`, or pc-offload[int8]), or use state_dtype='bf16'."
        ) from error
    return OptimState8bit


def check_available(dtype: StateDtype) -> None:
    """Fail at construction, not at the first step, when int8 cannot run."""
    if dtype is StateDtype.INT8:
        _torchao_8bit()


def quantizable(like: torch.Tensor) -> bool:
    return like.numel() >= _QUANT_MIN and like.numel() % _QUANT_BLOCK == 0


def zeros(like: torch.Tensor, dtype: StateDtype, signed: bool) -> torch.Tensor:
    """A zero moment shaped like the fp32 master ``like``, stored as ``dtype``."""
    if dtype is StateDtype.BF16:
        return torch.zeros(like.shape, dtype=torch.bfloat16, device=like.device)
    if dtype is StateDtype.INT8 and quantizable(like):
        state8: torch.Tensor = _torchao_8bit().zeros(
            like.shape, signed=signed, block_size=_QUANT_BLOCK, device=like.device
        )
        return state8
    return torch.zeros_like(like, dtype=torch.float32, memory_format=torch.preserve_format)


def moment_bytes(dtype: StateDtype) -> float:
    """Bytes per moment value in ``dtype`` (8-bit: the code plus its share
    of a block's fp32 scale), for the planners' accounting."""
    return {StateDtype.FP32: 4.0, StateDtype.BF16: 2.0, StateDtype.INT8: 1 + 4 / _QUANT_BLOCK}[
        dtype
    ]


def stored_bytes(moment: torch.Tensor) -> int:
    """Bytes ``moment`` keeps (codes and scales for 8 bits)."""
    if hasattr(moment, "codes"):
        quantized: Any = moment
        parts = (quantized.codes, quantized.scale)
        return sum(int(t.numel()) * t.element_size() for t in parts)
    return int(moment.numel()) * moment.element_size()


def is_narrow(moment: torch.Tensor) -> bool:
    """Stored in fewer bits than fp32."""
    return moment.dtype != torch.float32 or hasattr(moment, "codes")


def widen(moment: torch.Tensor) -> torch.Tensor:
    """A new fp32 tensor with ``moment``'s values."""
    if hasattr(moment, "codes"):
        quantized: Any = moment  # torchao's OptimState8bit
        out: torch.Tensor = quantized.dequantize()
        return out.float()
    return moment.detach().to(torch.float32, copy=True)


def narrow_into(moment: torch.Tensor, values: torch.Tensor) -> None:
    """Store fp32 ``values`` (from a checkpoint) into ``moment``, in its
    format [Note: 8-bit moments through a checkpoint]."""
    if hasattr(moment, "codes"):
        _write_block(moment, 0, moment.numel(), values.reshape(-1), from_levels=True)
    else:
        moment.copy_(values)


# [Note: 8-bit moments through a checkpoint]
# A checkpoint holds fp32 moments (what any optimizer reads), so an 8-bit
# moment is saved as its dequantised values, code level x block scale, and
# narrowed again on load. torchao's scheme scales a block by its largest
# magnitude, mapping it to +-1; the signed map's lowest level is -0.99297,
# not -1, so a block whose extreme value is negative was stored at level
# -0.99297 x scale, and scaling its dequantised values again by their
# largest magnitude would shift every code of the block. On load (only), a
# block whose extreme is negative is scaled by it over 0.99297, which puts
# it back on its level: the codes come back the same and the scale to
# fp32 rounding of one division, so a resumed run continues the one that
# saved to the last bit of that scale.


def store(values: torch.Tensor, dtype: StateDtype, signed: bool) -> torch.Tensor:
    """fp32 ``values`` as a moment stored in ``dtype``: a new narrow tensor,
    or ``values`` themselves where that format keeps fp32 (fp32, or a
    tensor too small for 8 bits)."""
    stored = zeros(values, dtype, signed)
    if not is_narrow(stored):
        return values
    narrow_into(stored, values)
    return stored


def _read_block(moment: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    if hasattr(moment, "codes"):
        from torchao.optim.quant_utils import dequant_with_qmap

        quantized: Any = moment  # torchao's OptimState8bit
        codes = quantized.codes.view(-1)[lo:hi]
        scale = quantized.scale[lo // _QUANT_BLOCK : hi // _QUANT_BLOCK]
        block: torch.Tensor = dequant_with_qmap(codes, quantized.qmap, scale)
        return block
    return moment.view(-1)[lo:hi].float()


def _scale_from_levels(
    values: torch.Tensor, qmap: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales that put dequantised values back on their levels
    [Note: 8-bit moments through a checkpoint]."""
    blocks = values.view(-1, _QUANT_BLOCK)
    top, bottom = blocks.amax(-1), blocks.amin(-1)
    # A tie goes to the negative side: a positive value at that magnitude
    # cannot have been at level 1, or it would be the larger.
    negative = -bottom >= top
    scale = torch.where(negative, bottom / float(qmap.min()), top).clip(1e-12)
    return (blocks / scale.view(-1, 1)).view(values.shape), scale


def _write_block(
    moment: torch.Tensor, lo: int, hi: int, values: torch.Tensor, from_levels: bool = False
) -> None:
    if hasattr(moment, "codes"):
        from torchao.optim.quant_utils import quantize_8bit_with_qmap, scale_tensor

        quantized: Any = moment  # torchao's OptimState8bit
        if from_levels and float(quantized.qmap.min()) < 0:
            scaled, scale = _scale_from_levels(values, quantized.qmap)
        else:
            scaled, scale = scale_tensor(values, _QUANT_BLOCK)
        quantized.codes.view(-1)[lo:hi] = quantize_8bit_with_qmap(scaled, quantized.qmap)
        quantized.scale[lo // _QUANT_BLOCK : hi // _QUANT_BLOCK] = scale
    else:
        moment.view(-1)[lo:hi] = values


Kernel = Callable[..., None]


def round_stochastic_(out: torch.Tensor, values: torch.Tensor, generator: torch.Generator) -> None:
    """``out`` (bf16) = ``values`` (fp32) rounded stochastically: 16 random
    bits added below bf16's last bit, then cut off (fp32's upper half is a
    bf16, so the copy is exact). Unbiased: the expected result is the value."""
    bits = values.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, values.shape, dtype=torch.int32, device=values.device, generator=generator
    )
    out.copy_(((bits + noise) & -65536).view(torch.float32))


def rounding_generator(device: torch.device, step: int, position: int) -> torch.Generator:
    """The random bits of one tensor's rounding at one step: the same
    however the run was interrupted and resumed."""
    generator = torch.Generator(device=device)
    generator.manual_seed((step * 1_000_003 + position * 7_919 + 12_345) % (1 << 63))
    return generator


def step_blockwise(
    kernel: Kernel,
    master: torch.Tensor,
    grad: torch.Tensor,
    moments: Sequence[torch.Tensor],
    step: torch.Tensor,
    rounding: torch.Generator | None = None,
) -> None:
    """``kernel([master], [grad], [m], [v], [max_v], [step])`` over fp32
    blocks of a tensor whose moments are stored narrow, or whose master is
    bf16 (written back rounded stochastically with ``rounding``'s bits)
    [Note: low-precision optimizer states]. ``moments`` is (exp_avg,
    exp_avg_sq[, max_exp_avg_sq])."""
    flat_master, flat_grad = master.view(-1), grad.reshape(-1)
    numel = flat_master.numel()
    narrow_master = flat_master.dtype != torch.float32
    if narrow_master and rounding is None:
        raise ValueError("a bf16 master is written back with stochastic rounding: pass rounding")
    for lo in range(0, numel, _BLOCK):
        hi = min(numel, lo + _BLOCK)
        wide = [_read_block(m, lo, hi) for m in moments]
        block = flat_master[lo:hi].float() if narrow_master else flat_master[lo:hi]
        kernel([block], [flat_grad[lo:hi]], [wide[0]], [wide[1]], wide[2:], [step])
        if narrow_master and rounding is not None:
            round_stochastic_(flat_master[lo:hi], block, rounding)
        for moment, values in zip(moments, wide, strict=True):
            _write_block(moment, lo, hi, values)
