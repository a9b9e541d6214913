"""Copies at the host/device boundary inside one task, as few as the step allows.

After placement and partitioning each node of a task's partition runs on the task's CPU or
on one of its GPUs. A value lives where its producer wrote it: on the producer's device,
or in host memory for the outputs a device kernel gives in host memory (``Shape``'s, say:
``kernels.HOST_OUTPUTS``). A consumer reads it on its own device, or in host memory for the
inputs its device kernel takes there (shapes and axes: ``kernels.HOST_INPUTS``). Where the
two differ the edge gets a copy node: ``_HostToDevice`` or ``_DeviceToHost``, on the
device side, one per (value, destination) however many consumers share it. So a feed is
copied to a GPU once, a fetched GPU value back once, a value pulled from a PS (a
``_Recv``, which lands in host memory) once, and a GPU value sent to a PS once. Between
two GPUs a value goes through the host (two copies). A 0-d host value that an elementwise
GPU kernel reads beside a device array goes with the kernel's launch as a NumPy scalar
(``_HostScalar``), as CuPy takes scalars, with no copy at all. A copy of a value made
outside a loop and read in it stays outside, made once.

Each copy is put right after its producer in the step's node order: the executor runs
ready nodes in that order, and a value another task waits for must not be sent after a
receive that itself waits on that task.

This is TensorFlow's intra-task Send/Recv pair reduced to what it does on one host: the
executor runs a task's nodes in one thread, so no rendezvous is needed.
"""

from __future__ import annotations

from flowmill.kernels import HOST_INPUTS, HOST_OUTPUTS, SCALAR_INPUTS

from .device_names import device_type, host_of, parse_device
from .step_graph import Node, Ref, StepGraph


def _on_gpu(device: str) -> bool:
    return bool(device) and device_type(device) != "CPU"


def _holds(src: Node, i: int) -> str:
    """Where output ``i`` of ``src`` lives: its device, or host memory."""
    if src.type == "_HostScalar":
        return ANYWHERE
    if _on_gpu(src.device) and i not in HOST_OUTPUTS.get(src.type, ()):
        return src.device
    return ""


def _reads(n: Node, j: int) -> str:
    """Where ``n`` reads its input ``j``: its device, or host memory."""
    if _on_gpu(n.device) and j not in HOST_INPUTS.get(n.type, ()):
        return n.device
    return ""


ANYWHERE = "*"  # a NumPy scalar: any kernel reads it


class _Copier:
    def __init__(self):
        self.copies: dict[tuple[Node, int, str], Node] = {}
        self.added: list[Node] = []

    def to(self, ref: Ref, where: str, frames: tuple[str, ...], in_cf: bool) -> Ref:
        """``ref`` readable at ``where`` (a device, or "" for host memory)."""
        src, i = ref
        held = _holds(src, i)
        if held == where or held == ANYWHERE:
            return ref
        if held and where:  # GPU to another GPU: through the host
            return self.to(self.to(ref, "", frames, in_cf), where, frames, in_cf)
        key = (src, i, where)
        copy = self.copies.get(key)
        if copy is None:
            kind, device = ("_HostToDevice", where) if where else ("_DeviceToHost", held)
            label = parse_device(where)["device"].replace(":", "").lower() if where else "host"
            copy = Node(
                kind,
                f"{src.name}/_to_{label}_{i}",
                {},
                [ref],
                [],
                1,
                [src.dtypes[i]],
                [src.shapes[i]],
                device=device,
                frames=min(src.frames, frames, key=len),
                in_control_flow=src.in_control_flow or in_cf,
            )
            self.copies[key] = copy
            self.added.append(copy)
        return (copy, 0)

    def scalar(self, ref: Ref, frames: tuple[str, ...], in_cf: bool) -> Ref:
        """A host 0-d value as the NumPy scalar an elementwise device kernel takes."""
        src, i = ref
        key = (src, i, ANYWHERE)
        node = self.copies.get(key)
        if node is None:
            node = Node("_HostScalar", f"{src.name}/_scalar_{i}", {}, [ref], [], 1,
                        [src.dtypes[i]], [()], device=host_of(src.device),
                        frames=min(src.frames, frames, key=len),
                        in_control_flow=src.in_control_flow or in_cf)
            self.copies[key] = node
            self.added.append(node)
        return (node, 0)


def insert_copies(step: StepGraph) -> list[Node]:
    """Put a copy on every edge of ``step`` (one task's nodes) that crosses between host
    and device memory; fetched values come back to host memory. Returns the copies."""
    if not any(_on_gpu(n.device) for n in step.nodes):
        return []
    copier = _Copier()
    for n in list(step.nodes):
        wants = [_reads(n, j) for j in range(len(n.inputs))]
        held = [_holds(src, i) for src, i in n.inputs]
        inputs = []
        for j, r in enumerate(n.inputs):
            if (wants[j] and not held[j] and r[0].shapes[r[1]] == ()
                    and n.type in SCALAR_INPUTS and wants[j] in held):
                inputs.append(copier.scalar(r, n.frames, n.in_control_flow))
            else:
                inputs.append(copier.to(r, wants[j], n.frames, n.in_control_flow))
        n.inputs = inputs
    step.fetches = [copier.to(r, "", (), False) for r in step.fetches]
    after: dict[Node, list[Node]] = {}
    for copy in copier.added:
        after.setdefault(copy.inputs[0][0], []).append(copy)

    def with_copies(n: Node):
        yield n
        for copy in after.get(n, ()):
            yield from with_copies(copy)

    step.nodes = [m for n in step.nodes for m in with_copies(n)]
    return copier.added
