"""Placement: give every node of a step a full device name, keeping state with its users.

As in TensorFlow's placer, nodes are first joined into colocation groups with union-find:
ops built under ``colocate_with`` join their owner's group, and every op reading a
resource handle (a variable, a queue) joins the op that owns the resource. A group then
takes one device: the owner's request if it has one, else the single device its members
asked for. Unplaced input-less generators (constants) go where all their consumers are,
so a constant is never sent over the wire. Every decision is deterministic.

Where variables go in the first place is the job of a device function such as
``replica_device_setter``, applied while the graph is built, so model code stays the same
in one process and across PS and worker tasks. By default each variable goes to the PS
task holding the fewest bytes so far ("bytes"): dealing them out in turn ("round_robin")
puts every other variable on one task, which for a model of kernels and biases in turn
loads one task with every kernel. Either way the choice depends only on the graph's
variables in creation order, so every task running the same script agrees without
talking. ``ps_loads`` tells the bytes and variables each PS task ends up with.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from flowmill.kernels import HOST_INPUTS, HOST_ONLY, HOST_OUTPUTS, KERNELS, shapes

from .cluster import PS_STRATEGIES, ClusterSpec
from .device_names import (
    complete_device,
    device_type,
    host_of,
    merge_device,
    parse_device,
    split_task,
    task_name,
    task_of,
)
from .graph import Graph, Operation
from .step_graph import Node, StepGraph, topological_order

RESOURCE_OWNERS = frozenset(
    {
        "VarHandleOp",
        "FIFOQueueV2",
        "ConditionalAccumulator",
        "SparseConditionalAccumulator",
        "StalenessClock",
        "IteratorV2",
    }
)
PS_OPS = frozenset({"VarHandleOp"})
log = logging.getLogger("flowmill.placement")


class PlacementError(ValueError):
    pass


# ---- device functions


def variable_bytes(attrs: Mapping) -> int:
    """The bytes a variable (its ``VarHandleOp``'s shape and dtype attrs) holds; a shape
    not fully known counts as one element, as the placer cannot know more."""
    size = shapes.num_elements(attrs.get("shape"))
    return (1 if size is None else size) * np.dtype(attrs.get("dtype") or "float32").itemsize


@dataclass
class _ByBytes:
    """Each variable to the task holding the fewest bytes so far (the lowest-numbered of
    those tied), so big and small variables spread whatever order they come in."""

    num_tasks: int
    load: list[int] = field(default_factory=list)

    def __call__(self, op: Operation) -> int:
        if not self.load:
            self.load = [0] * self.num_tasks
        task = min(range(self.num_tasks), key=lambda i: (self.load[i], i))
        self.load[task] += variable_bytes(op.attrs)
        return task


@dataclass
class _RoundRobin:
    num_tasks: int
    next: int = 0

    def __call__(self, op: Operation) -> int:
        task = self.next
        self.next = (self.next + 1) % self.num_tasks
        return task


def replica_device_setter(
    ps_tasks: int | ClusterSpec,
    worker_device: str = "/job:worker/task:0",
    strategy: str = PS_STRATEGIES[0],
) -> Callable[[Operation], str]:
    """A device function: variables to PS tasks (``"bytes"``: least bytes first, the
    default; ``"round_robin"``: in turn), every other op to ``worker_device``. Use it as
    ``with graph.device(replica_device_setter(...))``."""
    n = ps_tasks.num_tasks("ps") if isinstance(ps_tasks, ClusterSpec) else int(ps_tasks)
    if strategy not in PS_STRATEGIES:
        raise ValueError(
            f"ps strategy must be one of {', '.join(PS_STRATEGIES)}, got {strategy!r}"
        )
    if n == 0:
        return lambda op: worker_device
    choose = _RoundRobin(n) if strategy == "round_robin" else _ByBytes(n)

    def device_fn(op: Operation) -> str:
        if op.type in PS_OPS:
            return task_name("ps", choose(op))
        return worker_device

    return device_fn


# ---- where unplaced variables go in a job


class VariablePlacer:
    """Sends the variables a script did not place to the PS tasks, the same way in every
    task of the job.

    A variable counts as unplaced when its ``VarHandleOp`` names no job and was not built
    under ``colocate_with``; it gets ``/job:ps/task:k`` (a device type it asked for is
    kept). ``k`` is chosen over the graph's variables in creation order, least bytes first
    (or round robin), so every worker running the same script agrees without talking.
    Whatever is colocated with a variable (its initializer, updates, optimizer slots,
    accumulators of a training mode) follows it: ``place`` joins resource users with their
    owner, and ops built under ``colocate_with`` are given the owner's device here, even
    when the owner itself is not part of the step.
    """

    def __init__(self, num_ps: int, strategy: str = PS_STRATEGIES[0]):
        if strategy not in PS_STRATEGIES:
            raise ValueError(
                f"variable placement strategy must be one of {', '.join(PS_STRATEGIES)}, "
                f"got {strategy!r}"
            )
        if num_ps < 1:
            raise ValueError(f"VariablePlacer needs at least one ps task, got {num_ps}")
        self.num_ps = num_ps
        self.strategy = strategy
        self._choose = replica_device_setter(num_ps, strategy=strategy)
        self._devices: dict[str, str] = {}  # VarHandleOp name -> its ps device
        self._graph: Graph | None = None
        self._scanned = 0
        self._lock = threading.Lock()

    def assignments(self, graph: Graph) -> dict[str, str]:
        """Variable op name -> ps device for every unplaced variable ``graph`` has so far.
        Ops added later extend the assignment; earlier ones never move."""
        with self._lock:
            if self._graph is None:
                self._graph = graph
            elif graph is not self._graph:
                raise ValueError("a VariablePlacer serves one graph")
            ops = graph.get_operations()
            for op in ops[self._scanned :]:
                if op.type in PS_OPS and not op.colocation and "job" not in parse_device(op.device):
                    self._devices[op.name] = merge_device(op.device, self._choose(op))
            self._scanned = len(ops)
            return self._devices

    def apply(self, step: StepGraph, graph: Graph) -> None:
        """Give the step's variables and everything colocated with them their ps device."""
        devices = self.assignments(graph)
        for node in step.nodes:
            op = node.op
            if op is None:
                continue
            owner = op.colocation[0] if op.colocation else op.name
            device = devices.get(owner)
            if device is not None:
                node.device = device

    def device_of(self, op: Operation, default_device: str) -> str:
        """The full device ``op`` (a variable, or an op colocated with one) runs on."""
        devices = self.assignments(op.graph)
        owner = op.colocation[0] if op.colocation else op.name
        device = devices.get(owner)
        if device is None and op.colocation:
            device = op.graph.get_operation_by_name(owner).device
        return complete_device(device if device is not None else op.device, default_device)


# ---- placing a step


class _UnionFind:
    def __init__(self):
        self.parent: dict = {}

    def find(self, x):
        self.parent.setdefault(x, x)
        root = x
        while self.parent[root] is not root:
            root = self.parent[root]
        while self.parent[x] is not root:  # path compression
            self.parent[x], x = root, self.parent[x]
        return root

    def union(self, a, b) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra is not rb:
            self.parent[rb] = ra


def colocation_groups(step: StepGraph) -> list[list[Node]]:
    """Nodes that must share a device, each group in step order."""
    uf = _UnionFind()
    by_name = {n.name: n for n in step.nodes}
    for n in step.nodes:
        uf.find(n)
        for name in n.op.colocation if n.op is not None else ():
            uf.union(by_name.get(name, name), n)  # an owner outside the step still groups
        for src, i in n.inputs:
            if src.dtypes[i].kind == "O":  # a resource handle: use it where it lives
                uf.union(src, n)
    groups: dict = {}
    for n in step.nodes:
        groups.setdefault(uf.find(n), []).append(n)
    return list(groups.values())


def place(step: StepGraph, default_device: str, gpus: int = 0, soft: bool = True) -> None:
    """Set ``node.device`` on every node to a full device name.

    With ``gpus``, the task of ``default_device`` has that many GPUs: a group of nodes on
    that task that asked for no device type goes to ``GPU:0`` when each of its ops has a
    GPU kernel and it holds no state (variables, queues, accumulators stay in host memory
    unless placed on a GPU); a group that asked for a GPU it cannot use (an op without a
    GPU kernel, a GPU the task lacks) goes to the CPU instead, said once per op type, or,
    without ``soft`` placement, is a ``PlacementError``."""
    default_device = complete_device("", default_device)
    own_task = task_of(default_device)
    explicit: set[Node] = set()
    for group in colocation_groups(step):
        owners = [m for m in group if m.type in RESOURCE_OWNERS and m.device]
        asked = owners or [m for m in group if m.device]
        devices = {complete_device(m.device, default_device) for m in asked}
        if len(devices) > 1:
            who = ", ".join(f"{m.name} on {m.device}" for m in asked)
            raise PlacementError(f"colocated ops ask for different devices: {who}")
        device = devices.pop() if devices else default_device
        if (gpus or not soft) and task_of(device) == own_task:
            typed = any("device" in parse_device(m.device) for m in asked)
            device = _choose_kind(group, device, typed, gpus, soft)
        for m in group:
            m.device = device
            if asked:
                explicit.add(m)
    _place_generators_with_consumers(step, explicit)
    if gpus and KEEP_SHAPE_MATH_ON_THE_HOST:
        _keep_shape_math_on_the_host(step)


_told_cpu: set[str] = set()


def _choose_kind(group: list[Node], device: str, typed: bool, gpus: int, soft: bool) -> str:
    """The device of a group on a task with ``gpus`` GPUs (soft placement)."""
    fields = parse_device(device)
    kind, _, ordinal = fields["device"].partition(":")
    if typed and kind == "CPU" or not typed and not gpus:
        return device
    if not typed and any(m.type in RESOURCE_OWNERS for m in group):
        return device  # state stays on the CPU unless a GPU was asked for
    without = sorted({m.type for m in group if m.type in HOST_ONLY or
                      (m.type, "GPU") not in KERNELS})
    cpu = device.rsplit("/device:", 1)[0] + "/device:CPU:0"
    index = int(ordinal or 0) if typed else 0
    if not soft and typed and (index >= gpus or without and without != ["_Arg"]):
        if index >= gpus:
            ops = [m for m in group if m.type != "_Arg"]
            why = f"this task has {gpus} GPU{'s' * (gpus != 1)}"
        else:
            ops = [m for m in group if m.type in without and m.type != "_Arg"]
            why = "; ".join(f"{t}: {HOST_ONLY.get(t, 'no GPU kernel')}"
                            for t in without if t != "_Arg")
        names = ", ".join(f"{m.name} ({m.type})" for m in ops[:5]) + \
            (f" and {len(ops) - 5} more" if len(ops) > 5 else "")
        raise PlacementError(f"cannot place {names} on GPU:{index} ({why}); "
                             "ConfigProto(allow_soft_placement=True) runs them on the CPU")
    if without:
        if typed and without != ["_Arg"]:  # a feed is always given in host memory
            for op_type in without:
                if op_type not in _told_cpu:
                    _told_cpu.add(op_type)
                    why = HOST_ONLY.get(op_type, "no GPU kernel")
                    log.warning("%s runs on the CPU: %s", op_type, why)
        return cpu
    if index >= gpus:
        key = f"GPU:{index}"
        if key not in _told_cpu:
            _told_cpu.add(key)
            log.warning("ops placed on GPU:%d run on the CPU: this task has %d GPU%s",
                        index, gpus, "s" * (gpus != 1))
        return cpu
    return device.rsplit("/device:", 1)[0] + f"/device:GPU:{index}"


def _place_generators_with_consumers(step: StepGraph, explicit: set[Node]) -> None:
    consumers: dict[Node, set[str]] = {}
    for n in step.nodes:
        host = HOST_INPUTS.get(n.type, ()) if device_type(n.device) != "CPU" else ()
        for j, (src, _) in enumerate(n.inputs):
            # A shape or an axis a GPU kernel reads in host memory is made on the host.
            consumers.setdefault(src, set()).add(host_of(n.device) if j in host else n.device)
    for n in step.nodes:
        if n in explicit or n.inputs or n.control or n.type == "_Arg":
            continue
        where = consumers.get(n)
        if where and len(where) == 1:
            n.device = next(iter(where))


SHAPE_MATH_ELEMENTS = 64
KEEP_SHAPE_MATH_ON_THE_HOST = True  # off only to put every GPU kernel to the test


def _keep_shape_math_on_the_host(step: StepGraph) -> None:
    """A pure node on a GPU whose inputs all live in host memory (shapes, sizes, host
    constants) and whose result is shape arithmetic (scalars, or integers of at most
    ``SHAPE_MATH_ELEMENTS`` elements) runs on its task's CPU, whatever device it asked
    for: as TensorFlow keeps int32 shape arithmetic in host memory, it saves a copy to the
    device and a kernel launch for a few numbers."""
    for n in topological_order(step.nodes):
        if device_type(n.device) == "CPU" or not n.inputs or n.stateful or n.frames:
            continue
        if not all(_in_host_memory(src, i) for src, i in n.inputs):
            continue
        if all(_shape_math(dtype, shape) for dtype, shape in zip(n.dtypes, n.shapes,
                                                                 strict=True)):
            n.device = host_of(n.device)


def _shape_math(dtype, shape) -> bool:
    """An integer or boolean result of a few elements, or a scalar: what shapes, sizes
    and counts are made of."""
    if shape is None or None in shape:
        return False
    return shape == () or (np.dtype(dtype).kind in "iub"
                           and int(np.prod(shape)) <= SHAPE_MATH_ELEMENTS)


def _in_host_memory(src: Node, i: int) -> bool:
    return device_type(src.device) == "CPU" or i in HOST_OUTPUTS.get(src.type, ())


def log_placement(step: StepGraph, config) -> None:
    """Where each node of ``step`` runs, on standard error, if ``config`` (a
    ``ConfigProto``) asks for it (``log_device_placement``)."""
    if config is not None and config.log_device_placement:
        print(f"Device mapping:\n{describe(step)}", file=sys.stderr, flush=True)


def describe(step: StepGraph) -> str:
    """Where each node runs, one line each, grouped by device, then the bytes and the count
    of variables each PS task holds: for people reading a job, where a skewed split of the
    variables shows as one PS task that is slow or out of memory."""
    width = max((len(n.name) for n in step.nodes), default=4)
    lines = []
    for n in sorted(step.nodes, key=lambda n: (n.device, n.name)):
        lines.append(f"{n.device:36} {n.name:{width}} {n.type}")
    loads = ps_loads((n.device, n.attrs) for n in step.nodes if n.type in PS_OPS)
    if loads:
        lines.append(format_loads(loads))
    return "\n".join(lines)


# ---- what each PS task holds


@dataclass(frozen=True)
class TaskLoad:
    """The variables one PS task holds: ``task`` (``ps-0``), their bytes and count."""

    task: str
    bytes: int
    variables: int


def ps_loads(variables: Iterable[tuple[str, Mapping]]) -> list[TaskLoad]:
    """Bytes and variables per PS task, in task order, from ``(device, attrs)`` of each
    variable's ``VarHandleOp`` (those not on a PS task are left out)."""
    found: dict[int, list[int]] = {}
    for device, attrs in variables:
        try:
            job, index = split_task(device)
        except ValueError:
            continue
        if job == "ps":
            load = found.setdefault(index, [0, 0])
            load[0] += variable_bytes(attrs)
            load[1] += 1
    return [TaskLoad(f"ps-{i}", *found[i]) for i in sorted(found)]


def format_loads(loads: list[TaskLoad]) -> str:
    """One line: ``variables on 2 PS tasks: ps-0 1.05 MB (3), ps-1 1.04 MB (3)``."""
    shown = ", ".join(f"{t.task} {format_bytes(t.bytes)} ({t.variables})" for t in loads)
    return f"variables on {len(loads)} PS task{'s' * (len(loads) != 1)}: {shown}"


def format_bytes(n: int) -> str:
    """``n`` bytes in decimal units, about three significant digits: ``512 B``,
    ``10.5 KB``, ``1.05 MB``."""
    if n < 1000:
        return f"{n} B"
    units = ("KB", "MB", "GB", "TB", "PB")
    value, i = n / 1000, 0
    while round(value) >= 1000 and i < len(units) - 1:
        value, i = value / 1000, i + 1
    digits = 2 if round(value, 2) < 10 else 1 if round(value, 1) < 100 else 0
    return f"{value:.{digits}f} {units[i]}"
