"""Pruning: from fetches and targets back to what they need, with feeds cutting the graph.

The result is a ``StepGraph``, the compile-time form a step's passes and executor work on:
feeds become ``_Arg`` nodes (so whatever produced a fed tensor is not run, unless some
other path needs it) and the user's graph is never changed.
"""

from __future__ import annotations

from typing import Any

from .graph import Operation, Tensor
from .step_graph import Node, Ref, StepGraph


def prune(fetches: list[Tensor], targets: list[Operation], feeds: list[Tensor]) -> StepGraph:
    fed = {t: i for i, t in enumerate(feeds)}
    args = [
        Node("_Arg", f"_arg_{t.name}", {"index": i}, [], [], 1, [t.dtype], [t.shape])
        for i, t in enumerate(feeds)
    ]
    built: dict[Operation, Node] = {}

    def ref(t: Tensor) -> Ref:
        i = fed.get(t)
        return (args[i], 0) if i is not None else (built[t.op], t.index)

    # Reverse walk from what the step must produce; fed tensors stop the walk.
    order: list[Operation] = []
    seen: set[Operation] = set()
    stack: list[Operation] = [t.op for t in fetches if t not in fed] + list(targets)
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        order.append(op)
        for t in op.inputs:
            if t not in fed and t.op not in seen:
                stack.append(t.op)
        for c in op.control_inputs:
            if c not in seen and not _all_fed(c, fed):
                stack.append(c)
    order.sort(key=lambda op: op.id)
    for op in order:
        built[op] = Node(
            op.type,
            op.name,
            op.attrs,
            [],
            [],
            len(op.outputs),
            [t.dtype for t in op.outputs],
            [t.shape for t in op.outputs],
            op=op,
            device=op.device,
            **_control_flow_fields(op),
        )
    for op in order:
        node = built[op]
        node.inputs = [ref(t) for t in op.inputs]
        # Waiting on an op whose every output is fed means waiting on those feeds.
        node.control = [
            ctrl
            for c in op.control_inputs
            for ctrl in ([args[fed[t]] for t in c.outputs] if _all_fed(c, fed) else [built[c]])
        ]
    return StepGraph(
        nodes=args + [built[op] for op in order],
        fetches=[ref(t) for t in fetches],
        targets=[built[op] for op in targets],
        feeds=args,
    )


def _control_flow_fields(op: Operation) -> dict[str, Any]:
    """``frames``, ``loop_role`` and ``in_control_flow`` of a node, read off its op's contexts."""
    loops = []
    ctx = op.cf_context
    while ctx is not None:
        if ctx.is_loop:
            loops.append(ctx)
        ctx = ctx.outer
    return {
        "frames": tuple(c.name for c in reversed(loops)),
        "loop_role": loops[0].role_of(op) if loops else None,
        "in_control_flow": op.cf_context is not None,
    }


def _all_fed(op: Operation, fed: dict) -> bool:
    return bool(op.outputs) and all(t in fed for t in op.outputs)
