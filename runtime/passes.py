"""Graph passes over a pruned step: common-subexpression elimination, constant folding,
max pooling moved ahead of the ReLU it follows, and the numerics checks a session may ask
for.

The optimizations leave stateful ops alone (a Variable read twice is two reads; an
AssignAdd is never merged or precomputed) and leave control flow alone (Switch, Merge and
loop frames keep their meaning only as written): none ever runs or rewrites a node of a
cond branch or a loop frame, so each pass terminates on any graph, loops of any shape
included (what it cannot run without the loop's condition it skips). Like TensorFlow's
graph optimizer, CSE and folding repeat (at most ``max_rounds`` times) until nothing
changes; then pooling moves ahead of ReLUs (one pass: what it rewrites is no longer its
pattern), and what no fetch or target needs any more is dropped.
"""

from __future__ import annotations

import numpy as np

from .executor import compile_step
from .step_graph import Node, Ref, StepGraph, topological_order

_CONTROL_FLOW = frozenset(
    {"Switch", "Merge", "Enter", "Exit", "NextIteration", "LoopCond", "_Arg", "Placeholder"}
)
FOLD_MAX_ELEMENTS = 1 << 20  # larger results stay computed: a constant this big costs memory


def optimize(step: StepGraph, resources, max_rounds: int = 10) -> StepGraph:
    for _ in range(max_rounds):
        changed = eliminate_common_subexpressions(step)
        changed |= fold_constants(step, resources)
        if not changed:
            break
    pool_before_relu(step)
    remove_dead_nodes(step)
    return step


def _pure(n: Node) -> bool:
    if n.type in _CONTROL_FLOW or n.stateful:
        return False
    if n.in_control_flow:
        return False  # inside cond/while: evaluation depends on the branch or iteration
    return all(d.kind != "O" for d in n.dtypes)


def _attr_key(value):
    if isinstance(value, np.ndarray):
        if value.size > 4096:
            return ("array", id(value))
        return ("array", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(_attr_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _attr_key(v)) for k, v in value.items()))
    if isinstance(value, np.dtype):
        return value.str
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def _replace_uses(step: StepGraph, mapping: dict[Node, Node]) -> None:
    def fix(ref: Ref) -> Ref:
        src, i = ref
        return (mapping.get(src, src), i)

    for n in step.nodes:
        n.inputs = [fix(r) for r in n.inputs]
        n.control = list(dict.fromkeys(mapping.get(c, c) for c in n.control))
    step.fetches = [fix(r) for r in step.fetches]
    step.targets = [mapping.get(t, t) for t in step.targets]


def eliminate_common_subexpressions(step: StepGraph) -> bool:
    seen: dict[tuple, Node] = {}
    mapping: dict[Node, Node] = {}
    for n in topological_order(step.nodes):
        if not _pure(n) or n.num_outputs == 0:  # an op without outputs has no value to share
            continue
        key = (
            n.type,
            n.device,  # the same value asked for on two devices is computed on each
            _attr_key(n.attrs),
            tuple((id(mapping.get(s, s)), i) for s, i in n.inputs),
            tuple(sorted(id(mapping.get(c, c)) for c in n.control)),
        )
        first = seen.setdefault(key, n)
        if first is not n:
            mapping[n] = first
    if not mapping:
        return False
    _replace_uses(step, mapping)
    step.nodes = [n for n in step.nodes if n not in mapping]
    return True


def fold_constants(step: StepGraph, resources) -> bool:
    """Run every pure node whose inputs are all constant once; replace it by a Const."""
    constant: set[Node] = set()
    for n in topological_order(step.nodes):
        if n.fixed_const or (
            _pure(n)
            and n.num_outputs > 0
            and all(s in constant for s, _ in n.inputs)
            and all(c in constant for c in n.control)
        ):
            constant.add(n)
    users: dict[Node, list[Node]] = {}
    for n in step.nodes:
        for s, _ in n.inputs:
            users.setdefault(s, []).append(n)
    fetched = {s for s, _ in step.fetches}
    # Fold the frontier: constant nodes (not already Const) that feed something non-constant.
    frontier = [
        n
        for n in step.nodes
        if n in constant
        and n.type != "Const"
        and (n in fetched or any(u not in constant for u in users.get(n, [])))
    ]
    frontier = [n for n in frontier if all(_small(s) for s in n.shapes)]
    if not frontier:
        return False
    refs = [(n, i) for n in frontier for i in range(n.num_outputs)]
    sub = StepGraph(nodes=[n for n in step.nodes if n in constant], fetches=refs, targets=[])
    values = compile_step(sub, resources, "CPU").run(())  # folded on the host
    mapping: dict[Node, Node] = {}
    out_nodes: dict[Ref, Node] = {}
    for (n, i), value in zip(refs, values, strict=True):
        const = Node(
            "Const",
            f"{n.name}/folded_{i}" if n.num_outputs > 1 else f"{n.name}/folded",
            {"value": np.asarray(value), "dtype": n.dtypes[i]},
            [],
            [],
            1,
            [n.dtypes[i]],
            [tuple(np.shape(value))],
            device=n.device,
        )
        out_nodes[(n, i)] = const
        if n.num_outputs == 1:
            mapping[n] = const
    for node in step.nodes:
        node.inputs = [(out_nodes[r], 0) if r in out_nodes else r for r in node.inputs]
    step.fetches = [(out_nodes[r], 0) if r in out_nodes else r for r in step.fetches]
    step.nodes = step.nodes + list(out_nodes.values())
    remove_dead_nodes(step)
    return True


def _small(shape) -> bool:
    if shape is None or any(d is None for d in shape):
        return True  # folded value's real size is checked by the caller's budget
    n = 1
    for d in shape:
        n *= d
    return n <= FOLD_MAX_ELEMENTS


def pool_before_relu(step: StepGraph) -> bool:
    """``MaxPool(Relu(x))`` becomes ``Relu(MaxPool(x))``, and its gradient
    ``ReluGrad(MaxPoolGrad(r, p, g), r)`` becomes ``MaxPoolGrad(x, p0, ReluGrad(g, p))``:
    the ReLU and its gradient run over the pooled tensor, a quarter of the elements under
    2x2 pooling, instead of the convolution's whole output (what TensorFlow's users get by
    writing the pool first; convnets write the ReLU first).

    Both are exact, ties included. ReLU is monotone, so the window maxima commute with it.
    Where a window's maximum is positive, ``x`` and ``relu(x)`` hold it at the same
    places, so MaxPoolGrad routes the gradient to the same first maximum; where it is not,
    the old ReluGrad zeroed whatever MaxPoolGrad routed and the new one zeroes the pooled
    gradient first. Rewritten only where nothing else reads the ReLU's output (or the
    pooling gradient), no control edge names them and no loop frame holds them, so no
    reader sees a changed value.
    """
    controls = {c for n in step.nodes for c in n.control} | set(step.targets)
    changed = False
    readers = _readers(step)
    for relu in [n for n in step.nodes if n.type == "Relu"]:
        users = readers.get(relu, [])
        pools = [u for u in users if u.type == "MaxPool" and u.inputs[0] == (relu, 0)]
        if len(pools) != 1:
            continue
        pool = pools[0]
        rest = [u for u in users if u is not pool]
        grad = _pool_relu_gradient(relu, pool, rest, readers)
        if rest and grad is None:
            continue
        # The pool's value moves to the ReLU and the ReLU gradient's to the pooling
        # gradient (a fetch of either follows it); the ReLU's own and the pooling
        # gradient's change, so nothing may fetch them. No control edge may name any.
        nodes = (relu, pool, *rest)
        fetched = {s for s, _ in step.fetches} - {pool, *(grad[1:] if grad else ())}
        if (controls.intersection(nodes) or fetched.intersection(nodes)
                or any(n.frames or n.in_control_flow or n.device != relu.device
                       for n in nodes)):
            continue
        x = relu.inputs[0]
        _redirect(step, pool, relu, skip=rest)
        pool.inputs = [x]
        relu.inputs = [(pool, 0)]
        relu.shapes = list(pool.shapes)
        if grad is not None:
            pool_grad, relu_grad = grad
            g = pool_grad.inputs[2]
            _redirect(step, relu_grad, pool_grad)
            relu_grad.inputs = [g, (relu, 0)]
            relu_grad.shapes = list(pool.shapes)
            pool_grad.inputs = [x, (pool, 0), (relu_grad, 0)]
        changed = True
        readers = _readers(step)  # the rewrite moved readers
    if changed:
        step.nodes = topological_order(step.nodes)
    return changed


def _readers(step: StepGraph) -> dict[Node, list[Node]]:
    readers: dict[Node, list[Node]] = {}
    for n in step.nodes:
        for src, _ in n.inputs:
            readers.setdefault(src, []).append(n)
    return readers


def _redirect(step: StepGraph, old: Node, new: Node, skip=()) -> None:
    """Every reader of ``old``'s output (but those in ``skip``), fetches too, reads
    ``new``'s instead."""
    for n in step.nodes:
        if n not in skip and n is not new:
            n.inputs = [(new, 0) if r == (old, 0) else r for r in n.inputs]
    step.fetches = [(new, 0) if r == (old, 0) else r for r in step.fetches]


def _pool_relu_gradient(relu: Node, pool: Node, rest: list[Node], readers):
    """``(MaxPoolGrad, ReluGrad)`` when ``rest`` (the ReLU's readers besides the pool) is
    exactly the pair of the backward pass: the pooling gradient of this pool, read only by
    the ReLU's gradient."""
    if len(rest) != 2:
        return None
    by_type = {n.type: n for n in rest}
    pool_grad, relu_grad = by_type.get("MaxPoolGrad"), by_type.get("ReluGrad")
    if pool_grad is None or relu_grad is None:
        return None
    if (pool_grad.inputs[:2] != [(relu, 0), (pool, 0)] or pool_grad.attrs != pool.attrs
            or relu_grad.inputs != [(pool_grad, 0), (relu, 0)]
            or readers.get(pool_grad) != [relu_grad]):
        return None
    return pool_grad, relu_grad


def remove_dead_nodes(step: StepGraph) -> None:
    """Keep what fetches and targets reach, plus every feed (its index is fixed)."""
    keep: set[Node] = set(step.feeds)
    stack = [s for s, _ in step.fetches] + list(step.targets)
    while stack:
        n = stack.pop()
        if n in keep:
            continue
        keep.add(n)
        stack.extend(s for s, _ in n.inputs)
        stack.extend(n.control)
    step.nodes = [n for n in step.nodes if n in keep]


# Producers whose outputs are not checked: constants (a NaN or Inf written into the graph
# is meant, a -inf mask say) and ops that pass on a value checked where it was made.
_UNCHECKED = frozenset(
    {"Const", "CheckNumerics", "Print", "Identity", "StopGradient", "Switch", "Merge", "Enter",
     "Exit", "NextIteration"}
)


def add_numerics_checks(step: StepGraph) -> None:
    """Put a CheckNumerics after every float output the step reads (feeds included), so
    the first op to make a NaN or Inf fails the step, named, before any op downstream of
    it runs (TensorFlow's ``enable_check_numerics``).

    Each check has its producer's device and loop frames and follows it in the step's
    order; every consumer, fetch and control dependency of the producer moves to it. The
    producer's inputs are given to it as well, for the shapes its error names (it reads
    nothing else of them, and the executor does not count those reads as uses)."""
    read = {r for n in step.nodes for r in n.inputs} | set(step.fetches)
    checks: dict[Ref, Node] = {}
    of_node: dict[Node, list[Node]] = {}
    nodes: list[Node] = []
    for n in step.nodes:
        nodes.append(n)
        if n.type in _UNCHECKED:
            continue
        for i, dtype in enumerate(n.dtypes):
            if (n, i) not in read or np.dtype(dtype).kind != "f":
                continue
            check = Node(
                "CheckNumerics",
                f"{n.name}/check_numerics_{i}",
                {"message": "", "producer": _describe_output(n, i)},
                [],
                [],
                1,
                [dtype],
                [n.shapes[i]],
                device=n.device,
                frames=n.frames,
                in_control_flow=n.in_control_flow,
            )
            checks[(n, i)] = check
            of_node.setdefault(n, []).append(check)
            nodes.append(check)
    if not checks:
        return

    def checked(ref: Ref) -> Ref:
        return (checks[ref], 0) if ref in checks else ref

    for n in step.nodes:
        n.inputs = [checked(r) for r in n.inputs]
        n.control = list(dict.fromkeys(c for d in n.control for c in of_node.get(d, [d])))
    for (n, i), check in checks.items():
        check.inputs = [(n, i), *n.inputs]
    step.fetches = [checked(r) for r in step.fetches]
    step.nodes = nodes


def _describe_output(n: Node, i: int) -> str:
    """What a numerics check of output ``i`` of ``n`` names when it fails."""
    if n.type == "_Arg":
        return f"the value fed to {n.name.removeprefix('_arg_')!r}"
    which = "the output" if n.num_outputs == 1 else f"output {i}"
    return f"{which} of op {n.name!r} ({n.type})"
