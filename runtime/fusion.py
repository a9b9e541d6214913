"""Elementwise fusion: on a GPU, a tree of elementwise ops becomes one ``_FusedElementwise``
node, one kernel launch instead of one per op.

A GPU step is launch-bound long before it is bound by arithmetic: an optimizer's update
is a dozen elementwise ops per variable, a layer's bias and activation two more, each a
kernel launch of a few microseconds on a few kilobytes. The pass joins an elementwise op
to its consumer when the consumer is an elementwise op on the same GPU and the only reader
of its output, so every group is a tree with one output (no cycle can form, and no
intermediate is needed elsewhere); the ops it knows are ``kernels.fusion.EXPRESSIONS``.
Ops in loops or conditional branches, and ops with control edges, are left alone.

A variable update (``Assign*VariableOp``) on a GPU whose new value is such a tree (or one
elementwise op), read by nothing else, takes the tree in: ``_FusedAssign`` computes the
variable's next value in the same kernel. (An optimizer's update of a variable and its
slots is one op already, ``ResourceApply*``: see ``kernels/training.py``.)

The pass runs on each task's partition after its copies are in, where devices are final;
on the CPU it does nothing (NumPy runs a fused program op by op, and loses its in-place
updates).
"""

from __future__ import annotations

from flowmill.kernels.fusion import EXPRESSIONS

from .device_names import device_type
from .step_graph import Node, StepGraph

ENABLED = True  # off only to compare fused with unfused steps


def _fusable(n: Node) -> bool:
    return (
        n.type in EXPRESSIONS
        and bool(n.device) and device_type(n.device) != "CPU"
        and not n.frames and not n.in_control_flow and not n.control
    )


def fuse_elementwise(step: StepGraph) -> list[Node]:
    """Fuse ``step`` in place; returns the fused nodes."""
    if not ENABLED:
        return []
    readers: dict[Node, int] = {}
    for n in step.nodes:
        for src, _ in n.inputs:
            readers[src] = readers.get(src, 0) + 1
        for c in n.control:
            readers[c] = readers.get(c, 0) + 2  # a control edge keeps a node whole
    for src, _ in step.fetches:
        readers[src] = readers.get(src, 0) + 2
    for t in step.targets:
        readers[t] = readers.get(t, 0) + 2

    def absorbed(src: Node, into: Node) -> bool:
        return _fusable(src) and src.device == into.device and readers.get(src) == 1

    inner = {src for n in step.nodes if _fusable(n)
             for src, _ in n.inputs if absorbed(src, n)}
    fused = []
    for root in [n for n in step.nodes if _fusable(n) and n not in inner]:
        program, inputs = _tree(root, lambda src, n: src in inner and absorbed(src, n))
        if len(program) < 2:
            continue
        root.attrs = {"program": tuple((t, a) for t, a, _ in program),
                      "fused": tuple(name for _, _, name in program)}
        root.type = "_FusedElementwise"
        root.inputs = inputs
        fused.append(root)
    gone = {n for n in inner if n.type != "_FusedElementwise"}
    for update in [n for n in step.nodes if n.type in _ASSIGNS]:
        value = update.inputs[1][0]
        if not (readers.get(value) == 1 and _fusable_update(update, value)):
            continue
        if value.type == "_FusedElementwise":
            program, names, inputs = value.attrs["program"], value.attrs["fused"], value.inputs
        else:
            program, names = ((value.type, tuple(("in", k) for k in range(len(value.inputs)))),), \
                (value.name,)
            inputs = value.inputs
        update.attrs = {"program": tuple(program), "fused": (*names, update.name),
                        "how": _ASSIGNS[update.type]}
        update.type = "_FusedAssign"
        update.inputs = [update.inputs[0], *inputs]
        gone.add(value)
        fused.append(update)
    step.nodes = [n for n in step.nodes if n not in gone]
    return [n for n in fused if n not in gone]


_ASSIGNS = {"AssignAddVariableOp": "add", "AssignSubVariableOp": "sub",
            "AssignVariableOp": "set"}


def _fusable_update(update: Node, value: Node) -> bool:
    """An update on a GPU whose new value is an elementwise op (or a fused tree of them)
    on the same GPU, read by nothing else."""
    handle = update.inputs[0][0]
    if update.type == "AssignVariableOp" and not (  # a new value must have the old's shape
        handle.type == "VarHandleOp" and handle.attrs.get("shape") is not None
            and tuple(handle.attrs["shape"]) == tuple(value.shapes[0] or (None,))
            and value.dtypes[0] == handle.attrs.get("dtype")):
        return False
    return (
        value.device == update.device
        and (value.type == "_FusedElementwise" or _fusable(value))
        and not update.frames and not update.in_control_flow
        and bool(update.device) and device_type(update.device) != "CPU"
    )


def _tree(root: Node, joins) -> tuple[list, list]:
    """The ops of ``root``'s tree in order (each ``(type, args, name)``) and its inputs."""
    program: list = []
    inputs: list = []
    slot: dict = {}

    def visit(n: Node) -> tuple[str, int]:
        args = []
        for ref in n.inputs:
            if joins(ref[0], n):
                args.append(visit(ref[0]))
                continue
            if ref not in slot:
                slot[ref] = len(inputs)
                inputs.append(ref)
            args.append(("in", slot[ref]))
        program.append((n.type, tuple(args), n.name))
        return ("op", len(program) - 1)

    visit(root)
    return program, inputs
