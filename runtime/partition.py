"""Partitioning: one subgraph per device, with a ``_Send``/``_Recv`` pair on every cut edge.

After placement every node has a device. Each data edge between two devices becomes a
``_Send`` on the producer's device and a ``_Recv`` on the consumer's, one pair per
(producer output, destination device) however many consumers share it, as in
TensorFlow's ``graph_partition.cc``. A control edge crosses as a tiny tensor. Feeds live
on the client's device and fetches are sent back to it, so the client's partition alone
returns values; every other partition runs its sends and targets to completion.

The pair meets in a rendezvous under ``src_device;dst_device;tensor;step_id``; the step
id is the only part that changes between steps, so partitions are built once per step
signature and reused.
"""

from __future__ import annotations

import numpy as np

from . import dtypes
from .step_graph import Node, Ref, StepGraph, loop_context, maybe_dead, topological_order


class PartitionError(ValueError):
    pass


def partition(step: StepGraph, client_device: str) -> dict[str, StepGraph]:
    """Split a placed step by device. The client's partition (always present) gets the
    feeds and the fetches; the others get targets only."""
    for n in step.feeds:
        if n.device != client_device:
            raise PartitionError(f"feed {n.name} is on {n.device}, not the client {client_device}")
    return _Partitioner(step, client_device).run()


class _Partitioner:
    def __init__(self, step: StepGraph, client_device: str):
        self.step = step
        self.client_device = client_device
        self.dead = maybe_dead(topological_order(step.nodes))
        self.parts: dict[str, StepGraph] = {client_device: StepGraph([], [], [])}
        self.recvs: dict[tuple[Node, int, str], Node] = {}
        self.tokens: dict[Node, Node] = {}

    def run(self) -> dict[str, StepGraph]:
        step, parts = self.step, self.parts
        loop_device: dict = {}
        for n in step.nodes:
            ctx = loop_context(n)
            if ctx is not None and loop_device.setdefault(ctx, n.device) != n.device:
                raise PartitionError(
                    f"while loop {ctx.name!r} spans {loop_device[ctx]} and {n.device} "
                    f"({n.name}); keep a loop on one device"
                )
            parts.setdefault(n.device, StepGraph([], [], [])).nodes.append(n)
        for n in list(step.nodes):
            n.inputs = [self.cross(r, n.device) for r in n.inputs]
            n.control = [c if c.device == n.device else self.cross_control(c, n) for c in n.control]
        client = parts[self.client_device]
        client.feeds = list(step.feeds)
        client.fetches = [self.cross(r, self.client_device) for r in step.fetches]
        for t in step.targets:
            parts[t.device].targets.append(t)
        return parts

    def cross(self, ref: Ref, dst: str) -> Ref:
        src, i = ref
        if src.device == dst:
            return ref
        key = (src, i, dst)
        if key not in self.recvs:
            attrs = {"tensor_name": f"{src.name}:{i}", "src_device": src.device, "dst_device": dst}
            send = Node(
                "_Send", f"{src.name}/_send_{i}/{dst}", dict(attrs), [ref], [], 0, device=src.device
            )
            recv = Node(
                "_Recv",
                f"{src.name}/_recv_{i}/{dst}",
                {
                    **attrs,
                    "dtype": src.dtypes[i],
                    "shape": src.shapes[i],
                    "may_be_dead": src in self.dead,
                },
                [],
                [],
                1,
                [src.dtypes[i]],
                [src.shapes[i]],
                device=dst,
            )
            self.parts[src.device].nodes.append(send)
            self.parts[src.device].targets.append(send)
            self.parts[dst].nodes.append(recv)
            self.recvs[key] = recv
        return (self.recvs[key], 0)

    def cross_control(self, c: Node, n: Node) -> Node:
        """A control edge crosses as a scalar produced after ``c`` runs on its device."""
        if c in self.dead:
            raise PartitionError(
                f"{n.name} on {n.device} waits on {c.name} on {c.device}, which may not run "
                "(it is on a conditional branch): keep conditional control edges on one device"
            )
        if c not in self.tokens:
            token = Node(
                "Const",
                f"{c.name}/_control",
                {"value": np.zeros((), np.bool_), "dtype": dtypes.bool_},
                [],
                [c],
                1,
                [dtypes.bool_],
                [()],
                device=c.device,
            )
            self.parts[c.device].nodes.append(token)
            self.tokens[c] = token
        return self.cross((self.tokens[c], 0), n.device)[0]
