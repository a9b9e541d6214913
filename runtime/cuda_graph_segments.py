"""Which parts of a step can be captured as CUDA graphs: the segments, and why a node is
left out. Pure functions over a placed step (copies in, fused); ``cuda_graphs`` runs what
they decide.

Each node gets a verdict (``classify``):

- a *kernel*: on the step's one GPU, outside loops and conditionals, never dead, not
  waiting on the step's frame, reading no host value that changes between steps; or a
  host node computed from shapes only (``Size`` of a device value, then ``Cast``): a
  capture runs it once, and its value holds for the shapes the graph is captured for;
- an *upload* (``_HostToDevice``) or a *download* (``_DeviceToHost``): done before or
  after a segment's launch when the segment holds every reader of the upload, or the
  producer of the download (a capture cannot copy host memory);
- *free*: a host node that depends on no feed, no state and no device value (shapes,
  constants), or a device constant or handle made once: each segment that reads one
  takes its own copy of it, as its value is the same at every launch;
- *outside*, with the reason: feeds, host nodes that depend on a feed, on state or on a
  device value, ``_Send``/``_Recv`` and other kernels that wait on the step's frame, loops
  and conditionals, a second GPU.

Kernels are then grouped as early as they can run (``levels``): a node outside that reads
what a segment makes runs after it, and every kernel that reads that node goes to a later
segment, so contracting each segment to one node leaves the step acyclic. Kernels that
read only constants and handles (a variable's read) go instead to the segment of their
readers. Kernels of one
level are split by the ``_Recv``s they wait on: one launch must not make a value that
another task waits for (sent without any receive) wait on a receive as well, which could
deadlock two tasks. A segment whose kernels launch fewer than ``MIN_KERNELS`` times (reads
of variables, identities and constants launch nothing) stays eager: one launch and the
copies around it would cost what they save.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field

from flowmill.kernels import FRAME_KERNELS, HOST_OUTPUTS

from .device_names import device_type
from .executor import BOUND_ONCE
from .step_graph import Node, Ref, StepGraph, deps, maybe_dead, topological_order

MIN_KERNELS = 2
# Node types whose kernels launch nothing on the device: a read hands out the variable's
# buffer, an identity its input, a constant or handle is made once.
_NO_LAUNCH = frozenset({"Identity", "StopGradient", "NoOp", "ReadVariableOp"}) | BOUND_ONCE


class Role(enum.Enum):
    KERNEL = "kernel"
    UPLOAD = "upload"
    DOWNLOAD = "download"
    FREE = "free"
    OUTSIDE = "outside"


@dataclass(frozen=True)
class Verdict:
    role: Role
    reason: str = ""  # why a node stays outside every segment


@dataclass(eq=False)
class Segment:
    """Nodes captured as one CUDA graph, and its boundary with the rest of the step."""

    name: str
    device: str
    nodes: list[Node]  # in step order: kernels, and the uploads and downloads around them
    free: list[Node] = field(default_factory=list)  # copied in: constants, handles, shapes
    # What the segment reads from outside: ("upload", host ref) for a value uploaded into
    # a buffer before the launch, ("value", ref) for a device value copied into one (or a
    # host value a kernel takes as it is).
    inputs: list[tuple[str, Ref]] = field(default_factory=list)
    outputs: list[Ref] = field(default_factory=list)  # what the step reads of it
    control: list[Node] = field(default_factory=list)  # nodes outside it waits for

    def output_kind(self, k: int) -> str:
        """"download" (host memory, after the launch), "host" (a host output of a device
        kernel: a shape) or "device"."""
        node, i = self.outputs[k]
        if node.type == "_DeviceToHost":
            return "download"
        on_host = not _on_gpu(node) or i in HOST_OUTPUTS.get(node.type, ())
        return "host" if on_host else "device"


def _on_gpu(n: Node) -> bool:
    return bool(n.device) and device_type(n.device) != "CPU"


def the_gpu(step: StepGraph) -> tuple[str | None, str | None]:
    """The one GPU ``step`` runs on, or why there is none to capture on."""
    gpus = {n.device for n in step.nodes if _on_gpu(n)}
    if len(gpus) == 1:
        return gpus.pop(), None
    return None, "it runs on no GPU" if not gpus else f"it spans {len(gpus)} GPUs"


def classify(step: StepGraph, gpu: str) -> dict[Node, Verdict]:
    """Each node's verdict (see the module's docstring)."""
    order = topological_order(step.nodes)
    dead = maybe_dead(order)
    verdicts: dict[Node, Verdict] = {}
    for n in order:
        verdicts[n] = _verdict(n, gpu, n in dead, verdicts)
    return verdicts


def _outside(reason: str) -> Verdict:
    return Verdict(Role.OUTSIDE, reason)


def _verdict(n: Node, gpu: str, dead: bool, verdicts: dict[Node, Verdict]) -> Verdict:
    free = [verdicts.get(d, _outside("")).role is Role.FREE for d in deps(n)]
    if n.frames or n.in_control_flow:
        return _outside("is in a loop or a conditional")
    if dead:
        return _outside("may receive a dead value")
    if n.type in FRAME_KERNELS:
        return _outside("waits on the step's rendezvous or state")
    if not _on_gpu(n):
        if n.type == "_Arg":
            return _outside("is a feed")
        if n.stateful or not all(is_free or _shaped(d, verdicts) for d, is_free in
                                  zip(_dep_refs(n), free, strict=True)):
            return _outside("runs on the host and depends on a feed or on state")
        return Verdict(Role.FREE if all(free) else Role.KERNEL)
    if n.device != gpu:
        return _outside(f"runs on another GPU ({n.device})")
    if n.type == "_HostToDevice":
        return Verdict(Role.UPLOAD)
    if n.type == "_DeviceToHost":
        return Verdict(Role.DOWNLOAD)
    if n.type in BOUND_ONCE and not deps(n):
        return Verdict(Role.FREE)
    for (src, i), is_free in zip(n.inputs, free, strict=False):
        if (not _on_gpu(src) or src.type == "_DeviceToHost") and not (
                is_free or _shaped((src, i), verdicts)):
            return _outside(f"reads a host value that changes between steps ({src.name})")
    return Verdict(Role.KERNEL)


def _dep_refs(n: Node) -> list[Ref | Node]:
    """``deps(n)`` as refs where they are data (control dependencies as nodes)."""
    return [*n.inputs, *n.control]


def _shaped(dep: Ref | Node, verdicts: dict[Node, Verdict]) -> bool:
    """Whether ``dep`` is a host value computed from shapes only: a host output of a
    device kernel (``Shape``, ``Size``), or a host kernel of a segment (which takes only
    such values and constants). Fixed by the shapes a segment is captured for."""
    if not isinstance(dep, tuple):
        return verdicts.get(dep, _outside("")).role is Role.KERNEL
    src, i = dep
    if verdicts.get(src, _outside("")).role is not Role.KERNEL:
        return False
    return not _on_gpu(src) or i in HOST_OUTPUTS.get(src.type, ())


def levels(step: StepGraph, verdicts: dict[Node, Verdict]) -> dict[Node, tuple]:
    """Each kernel's group: (its level, the ``_Recv``s it waits on). A kernel's level is
    the most any path to it has crossed from a kernel to a node outside and back."""
    level: dict[Node, int] = {}  # a kernel's segment level; else the gap it runs in
    recvs: dict[Node, frozenset] = {}
    groups: dict[Node, tuple] = {}
    for n in topological_order(step.nodes):
        kernel = verdicts[n].role is Role.KERNEL
        at = 0
        for d in deps(n):
            if d in level:  # not a loop's back edge
                crossed = verdicts[d].role is Role.KERNEL and not kernel
                at = max(at, level[d] + crossed)
        level[n] = at
        waits = frozenset().union(*(recvs.get(d, frozenset()) for d in deps(n)))
        recvs[n] = waits | {n} if n.type == "_Recv" else waits
        if kernel:
            groups[n] = (at, recvs[n])
    return _float_late(step, verdicts, groups)


def _float_late(step: StepGraph, verdicts: dict[Node, Verdict], groups: dict) -> dict:
    """Kernels that read only free nodes (a variable's read, what is computed from
    constants) go to the group of their readers where they have one: placed as early as
    they can run, they would be copied out of one segment into the next (a read is
    deferred to its first use anyway)."""
    floating: set[Node] = set()
    order = topological_order(step.nodes)
    for n in order:
        if n in groups and all(d in floating or verdicts[d].role is Role.FREE for d in deps(n)):
            floating.add(n)
    users = _users(step)
    for n in reversed(order):
        if n in floating:
            targets = {groups.get(u) for u in users[n]}
            if len(targets) == 1 and None not in targets:
                groups[n] = targets.pop()
    return groups


def find_segments(step: StepGraph, gpu: str, min_kernels: int = MIN_KERNELS
                  ) -> tuple[list[Segment], dict[Node, str]]:
    """The segments of ``step`` (in step order), and why each node outside them is."""
    verdicts = classify(step, gpu)
    groups: dict[tuple, list[Node]] = {}
    for n, g in levels(step, verdicts).items():
        groups.setdefault(g, []).append(n)
    group_of = {n: g for g, members in groups.items() for n in members}
    users = _users(step)
    for n in step.nodes:  # uploads read only by one group's kernels, downloads of one's
        role = verdicts[n].role
        if role is Role.UPLOAD:
            targets = {group_of.get(u) for u in users[n]}
            if len(targets) == 1 and None not in targets:
                groups[targets.pop()].append(n)
        elif role is Role.DOWNLOAD:
            sources = {group_of.get(d) for d in deps(n)}
            if len(sources) == 1 and None not in sources:
                groups[sources.pop()].append(n)
    position = {n: i for i, n in enumerate(step.nodes)}
    segments: list[Segment] = []
    why = {n: v.reason for n, v in verdicts.items() if v.role is Role.OUTSIDE}
    for members in groups.values():
        members.sort(key=position.__getitem__)
        launches = sum(verdicts[n].role is Role.KERNEL and n.type not in _NO_LAUNCH
                       and _on_gpu(n) for n in members)
        if launches < min_kernels:
            for n in members:
                why[n] = f"its segment would launch {launches} kernel(s), too few to pay"
            continue
        segments.append(Segment("", gpu, members))
    segments.sort(key=lambda s: position[s.nodes[0]])
    for k, seg in enumerate(segments):
        seg.name = f"cuda_graph_segment_{k}"
        _boundary(seg, step, verdicts, users, position)
    for n, v in verdicts.items():
        if v.role in (Role.UPLOAD, Role.DOWNLOAD) and not any(n in s.nodes for s in segments):
            why[n] = "copies between host and device for nodes outside every segment"
    return segments, why


def _users(step: StepGraph) -> dict[Node, list[Node]]:
    users: dict[Node, list[Node]] = {n: [] for n in step.nodes}
    for n in step.nodes:
        for d in deps(n):
            users.setdefault(d, []).append(n)
    return users


def _boundary(seg: Segment, step: StepGraph, verdicts, users, position) -> None:
    """Fill in what ``seg`` copies in (free nodes), reads, and gives the rest of the step."""
    members = set(seg.nodes)
    free: set[Node] = set()
    stack = [d for n in seg.nodes for d in deps(n)]
    while stack:
        d = stack.pop()
        if d not in free and d not in members and verdicts[d].role is Role.FREE:
            free.add(d)
            stack.extend(deps(d))
    seg.free = sorted(free, key=position.__getitem__)
    inside = members | free
    for n in seg.nodes:
        kind = "upload" if n.type == "_HostToDevice" else "value"
        for ref in n.inputs:
            if ref[0] not in inside and (kind, ref) not in seg.inputs:
                seg.inputs.append((kind, ref))
        seg.control += [c for c in n.control if c not in inside and c not in seg.control]
    fetched = set(step.fetches)
    for n in seg.nodes:
        if n.type == "_HostToDevice":
            continue
        read = {ref for u in users[n] if u not in members for ref in u.inputs if ref[0] is n}
        seg.outputs += [(n, i) for i in range(n.num_outputs) if (n, i) in read | fetched]


def segment_step(seg: Segment, captured: bool) -> tuple[StepGraph, dict[Node, Node]]:
    """``seg`` as a step of its own, with one ``_Arg`` per input, fetching its outputs; and
    each of its nodes' original. ``captured``: the step a capture records, whose uploads
    are done before the launch (their buffers are its ``_Arg``s) and whose outputs are
    device snapshots (``_DeviceCopy``), downloaded after the launch; else the segment as
    ordinary code, uploads and downloads in it."""
    args = []
    for k, (kind, (src, i)) in enumerate(seg.inputs):
        args.append(Node("_Arg", f"{seg.name}/input_{k}", {"index": k}, [], [], 1,
                         [src.dtypes[i]], [src.shapes[i]],
                         device=seg.device if kind == "upload" and captured else src.device))
    slot = {key: arg for key, arg in zip(seg.inputs, args, strict=True)}
    uploads = {n for n in seg.nodes if n.type == "_HostToDevice"}
    kept = [n for n in seg.nodes if not (captured and n in uploads)]
    clones = {n: dataclasses.replace(n) for n in seg.free + kept}

    def ref(r: Ref, kind: str = "value") -> Ref:
        if r[0] in clones:
            return (clones[r[0]], r[1])
        if r[0] in uploads:  # captured: the upload's buffer
            return (slot[("upload", r[0].inputs[0])], 0)
        return (slot[(kind, r)], 0)

    for n, c in clones.items():
        c.inputs = [ref(r, "upload" if n in uploads else "value") for r in n.inputs]
        c.control = [clones[d] for d in n.control if d in clones]
        if captured and n.type == "_DeviceToHost":
            c.type, c.attrs = "_DeviceCopy", {}
    fetches, snapshots = [], []
    for k, r in enumerate(seg.outputs):
        out = ref(r)
        if captured and seg.output_kind(k) == "device":
            node = Node("_DeviceCopy", f"{r[0].name}/_snapshot_{r[1]}", {}, [out], [], 1,
                        [r[0].dtypes[r[1]]], [r[0].shapes[r[1]]], device=seg.device)
            snapshots.append(node)
            out = (node, 0)
        fetches.append(out)
    # Free nodes read nothing the segment makes: first is a topological order.
    sub = StepGraph(args + list(clones.values()) + snapshots, fetches, [], args)
    return sub, {c: n for n, c in clones.items()}


def contract(step: StepGraph, segments: list[Segment], nodes: list[Node]) -> StepGraph:
    """``step`` with each segment replaced by its node (``nodes[k]`` for ``segments[k]``,
    reading ``segments[k].inputs`` and giving ``.outputs``). Free nodes no one else reads
    are dropped. ``step`` itself is left as it was."""
    owner = {n: k for k, seg in enumerate(segments) for n in seg.nodes}
    out_of = {r: (nodes[k], j) for k, seg in enumerate(segments)
              for j, r in enumerate(seg.outputs)}
    kept = [n for n in step.nodes if n not in owner]
    new = {n: dataclasses.replace(n) for n in kept}

    def ref(r: Ref) -> Ref:
        return out_of[r] if r in out_of else (new[r[0]], r[1])

    def dep(d: Node) -> Node:
        return nodes[owner[d]] if d in owner else new[d]

    for n in kept:
        new[n].inputs = [ref(r) for r in n.inputs]
        new[n].control = list(dict.fromkeys(dep(d) for d in n.control))
    for node in nodes:
        node.inputs = [ref(r) for r in node.inputs]
        node.control = list(dict.fromkeys(dep(d) for d in node.control))
    first = {seg.nodes[0]: nodes[k] for k, seg in enumerate(segments)}
    ordered = [first.get(n) or new.get(n) for n in step.nodes if n in first or n in new]
    fetches = [ref(r) for r in step.fetches]
    targets = list(dict.fromkeys(dep(t) for t in step.targets))
    free = {new[n] for seg in segments for n in seg.free if n in new}
    read = {r[0] for r in fetches} | set(targets)
    stack = [d for n in ordered if n not in free for d in deps(n)]
    while stack:  # what the kept nodes read, through free nodes that are read
        d = stack.pop()
        if d not in read:
            read.add(d)
            stack.extend(deps(d))
    ordered = [n for n in ordered if n in read or n not in free]
    return StepGraph(ordered, fetches, targets, [new[f] for f in step.feeds])
