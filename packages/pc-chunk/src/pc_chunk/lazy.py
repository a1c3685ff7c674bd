"""Lazy initialisation: build a model without memory, materialise it tensor
by tensor later, with exactly the values eager construction gives.

[Note: lazy initialisation]
Inside ``LazyInitContext()`` every tensor a factory creates (``torch.empty``
for a parameter, ``torch.ones`` for a mask buffer, ...) is a meta tensor:
the shapes are real, no memory is used. A dispatch mode records, per
storage, how it was made and every in-place operator applied to it since
(``normal_``, ``zero_``, ``copy_`` from another lazy tensor, a write through
a view such as the padding row of an embedding). Operators that make new
tensors from lazy ones (``torch.tril(ones)``, ``arange(...).float()``)
record their inputs at the version they had then.

``materialize(t)`` replays what ``t`` needs, and only that, on the device
eager construction would have used. Random operators are the reason this
is more than bookkeeping: eager construction draws every tensor from one
generator in construction order, and a wrapper materialises in another
order (chunk by chunk). So before each random operator the context saves
the generator's state and then advances the generator exactly as the
operator would, by running it once on a scratch tensor of the same shape
(freed at once; one tensor at a time, never the model). Replaying sets
the saved state, runs the operator, and puts the generator back, so the
values equal eager construction's with the same seed, in any order, and
the caller's random stream is untouched.

What cannot be deferred runs for real: an operator on lazy inputs that
returns a Python value (``.item()``, ``.tolist()``), or writes into a
non-lazy tensor, materialises its inputs first. Anything else an operator
does on meta is what it does at replay; a kernel whose meta output layout
differs from the real one is reported, not guessed.

Conversions are operators like any other: ``model.to(torch.bfloat16)``,
``.half()``, ``.float()`` or ``.to(device)``, inside the context or on a
lazy model after it, record a copy in the new dtype (or on the new device)
and the parameter stays lazy, the same Python object, so ties hold
([Note: conversions through .data]). Materialising then replays the
construction and the conversion: the eager values in the eager dtype.

``materialize_module(module)`` materialises a whole module in place (the
unsharded route); the ZeRO-3 wrappers instead materialise one parameter
at a time into its chunk, so no rank ever holds the whole model.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = [
    "LazyInitContext",
    "LazyTensor",
    "is_lazy",
    "materialize",
    "materialize_",
    "materialize_module",
]

_META = torch.device("meta")
# The C ``Tensor.data`` descriptor, which LazyTensor.data wraps
# [Note: conversions through .data].
_TENSOR_DATA: Any = vars(torch._C.TensorBase)["data"]


@dataclass(frozen=True)
class _Rng:
    generator: torch.Generator
    state: torch.Tensor


@dataclass
class _Node:
    """One recorded operator call; lazy tensor arguments are ``_Ref``s."""

    func: torch._ops.OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: _Rng | None
    device: torch.device | None = None  # factories: the device eager construction used
    output: int = 0  # which flat output (compute nodes)


@dataclass(eq=False)
class _Storage:
    """How one (meta) storage came to be: a factory or compute ``base``,
    then in-place ``steps``. Lazy tensors on the storage hold it, and so do
    the records of tensors computed from it: it lives as long as something
    may still be materialised from it."""

    device: torch.device
    base: _Node
    layout: tuple[tuple[int, ...], tuple[int, ...], int]
    steps: list[_Node] = field(default_factory=list)


@dataclass(frozen=True)
class _Ref:
    """A lazy tensor as an operator saw it: a view of ``storage`` after its
    first ``version`` steps (``None``: the storage the recorded step
    writes, which would otherwise refer to itself)."""

    storage: _Storage | None
    version: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype


# The records of the lazy tensors in the operator being dispatched, by
# storage address (filled from their wrappers, emptied after each operator).
_REGISTRY: dict[int, _Storage] = {}


def _key(t: torch.Tensor) -> int:
    return int(t.untyped_storage()._cdata)


def _recorded(t: object) -> bool:
    """A meta tensor whose storage has a record (the inside of a lazy tensor)."""
    return isinstance(t, torch.Tensor) and t.is_meta and _key(t) in _REGISTRY


def _layout(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    return tuple(t.size()), tuple(t.stride()), int(t.storage_offset())


def _ref(t: torch.Tensor, rec: _Storage | None = None) -> _Ref:
    """``t`` (a recorded meta tensor) as it is now."""
    rec = rec if rec is not None else _REGISTRY[_key(t)]
    return _Ref(rec, len(rec.steps), *_layout(t), t.dtype)


class LazyTensor(torch.Tensor):
    """What a factory returns inside :class:`LazyInitContext`: a tensor
    with the shape, dtype and device eager construction would give (so
    model code that checks them, or ``is_meta``, behaves as in eager), no
    storage, and a recorded meta tensor inside."""

    _inner: torch.Tensor
    _record: _Storage

    @staticmethod
    def __new__(cls, inner: torch.Tensor, record: _Storage) -> LazyTensor:
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            inner.size(),
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=record.device,
        )
        out._inner = inner
        out._record = record
        return out

    # [Note: conversions through .data]
    # ``nn.Module.to`` / ``.half()`` / ``.cuda()`` convert a parameter in
    # place with ``param.data = fn(param)`` (unless
    # ``torch.__future__.get_swap_module_params_on_conversion()`` swaps the
    # tensors whole, which needs nothing here). The C setter copies only the
    # wrapper's metadata (dtype, shape, device) from the new tensor, not its
    # Python attributes: the wrapper would say bfloat16 while ``_inner`` and
    # ``_record`` still describe the float32 tensor, and materialising would
    # give float32. So the setter also takes over the new tensor's record; a
    # real (non-lazy) value materialises the parameter with that value, as
    # ``.data =`` on an eager tensor would.
    @property
    def data(self) -> torch.Tensor:
        value: torch.Tensor = _TENSOR_DATA.__get__(self)
        return value

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"a lazy tensor's .data must be a tensor; got {type(value).__name__}.")
        if not isinstance(value, LazyTensor):
            _become(self, value.detach())
            return
        _TENSOR_DATA.__set__(self, value)
        self._inner = value._inner
        self._record = value._record

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        kind = "Parameter" if getattr(self, "_is_param", False) else "LazyTensor"
        return f"{kind}(lazy, size={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        # Outside the context, operators on lazy tensors keep recording.
        return _dispatch(func, args, kwargs or {})


def is_lazy(t: object) -> bool:
    """Whether ``t`` was built inside a :class:`LazyInitContext` and not
    materialised yet."""
    return isinstance(t, LazyTensor)


def _unwrap(x: Any) -> Any:
    if isinstance(x, LazyTensor):
        _REGISTRY[_key(x._inner)] = x._record
        return x._inner
    return x


def _wrap(x: Any) -> Any:
    if _recorded(x):
        return LazyTensor(x, _REGISTRY[_key(x)])
    return x


def _generator(device: torch.device, kwargs: dict[str, Any]) -> torch.Generator:
    given = kwargs.get("generator")
    if isinstance(given, torch.Generator):
        return given
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    raise NotImplementedError(
        f"LazyInitContext: random initialisation on {device.type} is not supported (cpu and "
        "cuda are); build the model on one of those."
    )


@contextmanager
def _replaying(rng: _Rng | None) -> Iterator[None]:
    if rng is None:
        yield
        return
    saved = rng.generator.get_state()
    rng.generator.set_state(rng.state)
    try:
        yield
    finally:
        rng.generator.set_state(saved)


# -- replay ------------------------------------------------------------------------------


class _Replay:
    """Materialises refs; a storage needed at one version twice is built once."""

    def __init__(self) -> None:
        self._built: dict[tuple[int, int], torch.Tensor] = {}

    def value(self, ref: _Ref) -> torch.Tensor:
        assert ref.storage is not None
        base = self.storage(ref.storage, ref.version)
        return self._view(base, ref)

    @staticmethod
    def _view(base: torch.Tensor, ref: _Ref) -> torch.Tensor:
        if ref.dtype == base.dtype:
            return base.as_strided(ref.size, ref.stride, ref.offset)
        out = torch.empty(0, dtype=ref.dtype, device=base.device)
        return out.set_(base.untyped_storage(), ref.offset, ref.size, ref.stride)

    def _resolve(self, value: Any, own: _Storage | None, real: torch.Tensor | None) -> Any:
        def one(x: Any) -> Any:
            if not isinstance(x, _Ref):
                return x
            if x.storage is None or x.storage is own:
                assert real is not None
                return self._view(real, x)
            return self.value(x)

        return tree_map(one, value)

    def storage(self, rec: _Storage, version: int) -> torch.Tensor:
        key = (id(rec), version)
        if key in self._built:
            return self._built[key]
        node = rec.base
        args = self._resolve(node.args, None, None)
        kwargs = self._resolve(node.kwargs, None, None)
        if node.device is not None:
            kwargs = {**kwargs, "device": node.device}
        with _replaying(node.rng), torch.no_grad():
            out = node.func(*args, **kwargs)
        flat, _ = tree_flatten(out)
        real: torch.Tensor = flat[node.output]
        layout = _layout(real)
        if layout != rec.layout:
            raise RuntimeError(
                f"LazyInitContext: {node.func} gave layout {layout} for real but {rec.layout} "
                "on the meta device, so the recorded views cannot be replayed. Build this "
                "tensor outside the context."
            )
        for step in rec.steps[:version]:
            step_args = self._resolve(step.args, rec, real)
            step_kwargs = self._resolve(step.kwargs, rec, real)
            with _replaying(step.rng), torch.no_grad():
                step.func(*step_args, **step_kwargs)
        self._built[key] = real
        return real


def materialize(t: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """The value eager construction gave ``t`` ([Note: lazy initialisation]),
    as a new tensor on ``device`` (default: where eager construction put it)."""
    if not isinstance(t, LazyTensor):
        raise ValueError(
            "materialize() needs a tensor built inside LazyInitContext; got "
            + ("a meta tensor without a recipe" if t.is_meta else f"a {t.device.type} tensor")
            + "."
        )
    rec = t._record
    ref = _ref(t._inner, rec)
    base = _Replay().storage(rec, ref.version)
    whole = rec.layout == _layout(t._inner) and ref.dtype == base.dtype
    value = base if whole else _Replay._view(base, ref).clone()
    return value.to(device) if device is not None else value


def materialize_(t: torch.Tensor, device: torch.device | str | None = None) -> torch.Tensor:
    """Replace the lazy ``t`` in place (the same Python object, so a module
    and anything tied to it see the change) by its real value; returns ``t``."""
    _become(t, materialize(t, device))
    return t


def _become(t: torch.Tensor, value: torch.Tensor) -> None:
    """Turn the lazy ``t`` in place into a real tensor holding ``value``
    (shared, not copied), keeping its kind (parameter or not), its
    ``requires_grad`` and the attributes model code set on it. The record
    is dropped, so what it captured can be freed."""
    new: torch.Tensor
    if getattr(t, "_is_param", False):
        new = nn.Parameter(value, requires_grad=t.requires_grad)
    else:
        new = value.requires_grad_(t.requires_grad)
    internal = ("_inner", "_record", "_is_param")
    new.__dict__.update({k: v for k, v in t.__dict__.items() if k not in internal})
    torch.utils.swap_tensors(t, new)  # type: ignore[no-untyped-call]


def materialize_module(module: nn.Module, device: torch.device | str | None = None) -> nn.Module:
    """Materialise every lazy parameter and buffer of ``module`` in place."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if is_lazy(tensor):
            materialize_(tensor, device)
    return module


# -- recording ---------------------------------------------------------------------------


def _flat_tensors(value: Any) -> list[torch.Tensor]:
    flat, _ = tree_flatten(value)
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _random(func: torch._ops.OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags


def _capture(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return _ref(x) if _recorded(x) else x.detach().clone()
    return x


def _as_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and not x.is_meta:
        return x.to(_META)
    return x


def _register(t: torch.Tensor, node: _Node, device: torch.device) -> None:
    _REGISTRY[_key(t)] = _Storage(device, node, _layout(t))


def _written(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[torch.Tensor]:
    """The tensors the operator writes into (``self`` of ``normal_``, ``out=``)."""
    values: list[Any] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            values.append(args[i] if i < len(args) else kwargs.get(arg.name))
    return _flat_tensors(values)


def _dispatch(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """One operator on (possibly) lazy tensors [Note: lazy initialisation]."""
    if torch.Tag.inplace_view in func.tags and isinstance(args[0], LazyTensor):
        # ``t_()``, ``unsqueeze_()``: only the metadata changes. The inner
        # meta tensor takes the change; the wrapper is rebuilt around it.
        this = args[0]
        func(this._inner, *tree_map(_unwrap, args[1:]), **tree_map(_unwrap, kwargs))
        torch._C._swap_tensor_impl(this, LazyTensor(this._inner, this._record))
        return this
    try:
        return _record_op(func, *tree_map(_unwrap, (args, kwargs)))
    finally:
        _REGISTRY.clear()


def _record_op(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    inputs = _flat_tensors((args, kwargs))
    lazy = [t for t in inputs if _recorded(t)]
    if not lazy:
        return func(*args, **kwargs)
    written = _written(func, args, kwargs)
    returns_values = any(not str(r.type).startswith("Tensor") for r in func._schema.returns)
    if returns_values or any(not _recorded(t) for t in written):
        return _eager(func, args, kwargs)
    rng = _advance(func, args, kwargs, written) if _random(func) else None
    node_args, node_kwargs = tree_map(_capture, (args, kwargs))
    # On meta: real inputs go as meta copies, a target device as meta (the
    # node keeps the real one for the replay).
    target = kwargs.get("device")
    meta_args, meta_kwargs = tree_map(_as_meta, (args, kwargs))
    if target is not None:
        meta_kwargs["device"] = _META
    out = func(*meta_args, **meta_kwargs)
    for mutated in written:
        rec = _REGISTRY[_key(mutated)]

        def own(x: Any, rec: _Storage = rec) -> Any:
            return replace(x, storage=None) if isinstance(x, _Ref) and x.storage is rec else x

        step_args, step_kwargs = tree_map(own, (node_args, node_kwargs))
        rec.steps.append(_Node(func, step_args, step_kwargs, rng))
    lazy_keys = {_key(t) for t in lazy}
    device = torch.device(target) if target is not None else _REGISTRY[_key(lazy[0])].device
    for index, result in enumerate(_flat_tensors(out)):
        if result.is_meta and _key(result) not in lazy_keys:
            _register(result, _Node(func, node_args, node_kwargs, rng, output=index), device)
    return tree_map(_wrap, out)


def _factory(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    device = torch.device(kwargs.get("device") or "cpu")
    if device.type == "meta":
        return func(*args, **kwargs)
    rng = None
    if _random(func):
        generator = _generator(device, kwargs)
        rng = _Rng(generator, generator.get_state())
        func(*args, **kwargs)  # advance the generator as eager construction would
    meta_kwargs = {**kwargs, "device": _META}
    meta_kwargs.pop("pin_memory", None)
    out = func(*args, **meta_kwargs)
    rest = {k: v for k, v in kwargs.items() if k != "device"}
    try:
        for index, result in enumerate(_flat_tensors(out)):
            _register(result, _Node(func, args, rest, rng, device, index), device)
        return tree_map(_wrap, out)
    finally:
        _REGISTRY.clear()


def _advance(
    func: torch._ops.OpOverload,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    written: list[torch.Tensor],
) -> _Rng:
    """Save the generator's state, then move it on as the real operator
    would: run it once on scratch tensors (written ones) and real values
    (read ones), and drop the result."""
    lazy = [t for t in _flat_tensors((args, kwargs)) if _recorded(t)]
    device = _REGISTRY[_key(lazy[0])].device
    generator = _generator(device, kwargs)
    rng = _Rng(generator, generator.get_state())
    written_ids = {id(t) for t in written}
    replay = _Replay()

    maps: list[mmap.mmap] = []

    def real(x: Any) -> Any:
        if not _recorded(x):
            return x
        if id(x) in written_ids:
            return _scratch(x, device, maps)
        return replay.value(_ref(x))

    with torch.no_grad():
        func(*tree_map(real, args), **tree_map(real, kwargs))
    for mapping in maps:  # [Note: scratch outside the heap]
        with suppress(BufferError):  # still viewed somewhere: unmapped when that goes
            mapping.close()
    return rng


# [Note: scratch outside the heap]
# A host scratch tensor as large as a parameter, freed at once, would come
# from malloc's heap (glibc raises its mmap threshold as large blocks are
# freed, and pc-comm's tune_host_allocator raises it for good): the small
# records allocated between two parameters split the freed block, the next
# scratch does not fit, and the heap grows by about the whole model over a
# build, which the process keeps. Scratch tensors of 1 MiB and more are
# therefore anonymous mappings of their own, unmapped when the operator is
# done, so a lazy build's memory stays the records' and one tensor's.
_SCRATCH_MAP_BYTES = 1 << 20


def _scratch(x: torch.Tensor, device: torch.device, maps: list[mmap.mmap]) -> torch.Tensor:
    """An uninitialised tensor of ``x``'s size, stride and dtype on ``device``."""
    span = (
        1 + sum((n - 1) * s for n, s in zip(x.size(), x.stride(), strict=True)) if x.numel() else 0
    )
    nbytes = span * x.element_size()
    if device.type != "cpu" or nbytes < _SCRATCH_MAP_BYTES:
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=device)
    mapping = mmap.mmap(-1, nbytes)
    maps.append(mapping)
    flat = torch.frombuffer(mapping, dtype=x.dtype, count=span)
    return flat.as_strided(x.size(), x.stride())


def _eager(func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What cannot be deferred (a Python value, a write into a real tensor)
    runs on materialised inputs."""
    replay = _Replay()

    def real(x: Any) -> Any:
        return replay.value(_ref(x)) if _recorded(x) else x

    return func(*tree_map(real, args), **tree_map(real, kwargs))


class LazyInitContext(TorchDispatchMode):
    """Build a model without allocating it [Note: lazy initialisation]::

        with LazyInitContext():
            model = GPT2LMHeadModel(config)   # lazy tensors, recorded
        model = FullyShardedDataParallel(model)  # materialised shard by shard

    ``materialize_module(model)`` gives the eager model instead. A
    ``model.to(dtype)`` (or ``.half()``, ``.bfloat16()``, ``.to(device)``)
    inside the context, or on the lazy model after it, is recorded and
    replayed with the rest.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]

    def __torch_dispatch__(
        self,
        func: torch._ops.OpOverload,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if not _flat_tensors((args, kwargs)):
            return _factory(func, args, kwargs)
        return _dispatch(func, args, kwargs)
