"""A stage's backward split into the input gradient and the weight gradient.

[Note: splitting backward]
Zero-bubble schedules send the gradient of a stage's input upstream as soon
as it is known (``I``) and compute the weight gradients later (``W``). Both
come from one autograd graph. ``I`` asks autograd for the input gradients
only, so every node runs with only the outputs that lead to the inputs (a
linear layer's backward computes the gradient of its activation, not of its
weight). On the way, a pre-hook records the gradient arriving at each node
where the path to the inputs and a path to some parameter part: the
*intermediates*. ``W`` restarts backward from each intermediate with the
recorded gradient, asking only for the parameters that hang below it.

A parameter reached from two intermediates (a weight used twice inside one
stage) would be counted twice by two restarts, since the second restart also
walks through the first intermediate. Such parameters are few, so ``I``
computes them directly. Parameters no input path touches at all (the first
stage has no input gradient) are computed by ``W`` from the stage's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

__all__ = ["WeightGradWork", "backward_input", "backward_weight"]


@dataclass
class WeightGradWork:
    """What ``W`` needs, kept from ``I``."""

    # intermediate node -> (its parameters, gradients recorded at it)
    restarts: list[tuple[Node, list[torch.Tensor], list[torch.Tensor | None]]] = field(
        default_factory=list
    )
    # outputs whose graph never meets an input, with their gradients
    roots: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)
    root_params: list[torch.Tensor] = field(default_factory=list)


def _leaf(node: Node) -> torch.Tensor | None:
    variable = getattr(node, "variable", None)
    return variable if isinstance(variable, torch.Tensor) else None


def _children(node: Node) -> list[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _reaches_inputs(roots: Sequence[Node], inputs: set[int]) -> dict[Node, bool]:
    """For every node below ``roots``: does some input leaf hang below it?"""
    memo: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(n, False) for n in roots]
    while stack:
        node, expanded = stack.pop()
        if node in memo:
            continue
        leaf = _leaf(node)
        if leaf is not None:
            memo[node] = id(leaf) in inputs
            continue
        kids = _children(node)
        if expanded:
            memo[node] = any(memo[k] for k in kids)
            continue
        stack.append((node, True))
        stack.extend((k, False) for k in kids if k not in memo)
    return memo


def _params_below(
    node: Node, params: dict[int, torch.Tensor], memo: dict[Node, set[int]]
) -> set[int]:
    stack: list[tuple[Node, bool]] = [(node, False)]
    while stack:
        current, expanded = stack.pop()
        if current in memo:
            continue
        leaf = _leaf(current)
        if leaf is not None:
            memo[current] = {id(leaf)} if id(leaf) in params else set()
            continue
        kids = _children(current)
        if expanded:
            memo[current] = set().union(*(memo[k] for k in kids)) if kids else set()
            continue
        stack.append((current, True))
        stack.extend((k, False) for k in kids if k not in memo)
    return memo[node]


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor | None],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[torch.Tensor | None], WeightGradWork]:
    """Gradients of ``inputs`` (None where an input got none), and the work
    ``W`` finishes later [Note: splitting backward]."""
    by_id = {id(p): p for p in params if p.requires_grad}
    input_ids = {id(x) for x in inputs}
    root_nodes: list[Node] = []
    for out in outputs:
        node = out.grad_fn
        assert node is not None, "outputs passed to backward_input must carry a graph"
        root_nodes.append(node)
    reaches = _reaches_inputs(root_nodes, input_ids)
    below: dict[Node, set[int]] = {}
    owners: dict[int, list[Node | None]] = {}  # param -> intermediates (None: a root)
    for node, on_path in reaches.items():
        if not on_path or _leaf(node) is not None:
            continue
        found: set[int] = set()
        for child in _children(node):
            if not reaches.get(child, False):
                found |= _params_below(child, by_id, below)
        for pid in found:
            owners.setdefault(pid, []).append(node)
    work = WeightGradWork()
    from_roots: set[int] = set()
    for out, grad, node in zip(outputs, output_grads, root_nodes, strict=True):
        if not reaches[node]:
            work.roots.append((out, grad))
            from_roots |= _params_below(node, by_id, below)
    for pid in from_roots:
        owners.setdefault(pid, []).append(None)
    direct = [by_id[pid] for pid, places in owners.items() if len(places) > 1]
    groups: dict[Node, list[torch.Tensor]] = {}
    for pid, places in owners.items():
        if len(places) == 1:
            if places[0] is None:
                work.root_params.append(by_id[pid])
            else:
                groups.setdefault(places[0], []).append(by_id[pid])
    if not work.root_params:
        work.roots = []
    captured: dict[Node, tuple[Any, ...]] = {}
    handles = [
        node.register_prehook(lambda grads, node=node: captured.__setitem__(node, grads))
        for node in groups
    ]
    wanted = [x for x in inputs if x.requires_grad]
    try:
        results: tuple[torch.Tensor | None, ...] = ()
        if wanted or direct:
            results = torch.autograd.grad(
                list(outputs),
                [*wanted, *direct],
                grad_outputs=list(output_grads),
                retain_graph=True,
                allow_unused=True,
            )
    finally:
        for handle in handles:
            handle.remove()
    by_input = dict(zip((id(x) for x in wanted), results[: len(wanted)], strict=True))
    for param, grad in zip(direct, results[len(wanted) :], strict=True):
        _accumulate(param, grad)
    for node, group in groups.items():
        grads = captured.get(node)
        if grads is not None:
            work.restarts.append((node, group, list(grads)))
    return [by_input.get(id(x)) for x in inputs], work


def _accumulate(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    if grad is None:
        return
    if param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


def backward_weight(work: WeightGradWork) -> None:
    """The weight gradients ``I`` left, accumulated into ``param.grad``."""
    for node, group, grads in work.restarts:
        edges = [GradientEdge(node, i) for i, g in enumerate(grads) if g is not None]
        values = [g for g in grads if g is not None]
        if edges:
            torch.autograd.backward(edges, grad_tensors=values, inputs=group, retain_graph=True)
    if work.root_params:
        torch.autograd.backward(
            [o for o, _ in work.roots],
            grad_tensors=[g for _, g in work.roots],
            inputs=work.root_params,
            retain_graph=True,
        )
    work.restarts.clear()
    work.roots.clear()
