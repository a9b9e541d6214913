"""Partitioning: one subgraph per task, with a ``_Send``/``_Recv`` pair on every cut edge.

After placement every node has a device. Each data edge between two tasks becomes a
``_Send`` on the producer's task and a ``_Recv`` on the consumer's, one pair per
(producer output, destination task) however many consumers share it, as in
TensorFlow's ``graph_partition.cc``. A control edge crosses as a tiny tensor, except into
a join (``_joins``), where the step's own end does its work. Feeds live
on the client's device and fetches are sent back to it, so the client's partition alone
returns values; every other partition runs its sends and targets to completion.

A partition is keyed by its task's CPU device, and its ``_Send``s and ``_Recv``s run
there: the tensor channel moves host memory. The edges between a task's CPU and its GPUs
are not cut here; ``copies.insert_copies`` puts host/device copies on them, in each task.

A small constant read on another task is not sent: that task gets a copy of the ``Const``
(``DUPLICATE_CONST_BYTES``), as a constant costs nothing to make where it is used. A
hyperparameter colocated with the global step (a learning rate, read by every variable's
update on every PS task) would otherwise be one more pull per step, on the update's
critical path.

Control edges cost a message each way they cross, so two rules keep them few. A ``NoOp``
that only relays a wait (``_relays``: an optimizer's ``group()`` of its updates, which the
global step's increment waits on) runs on the task whose ops wait on it, when that cuts
fewer edges than where it was placed: placed on the worker, the updates on a PS task
would each send it a token and it would send one back, every step, though nothing on the
worker waits. And an op that waits on several ops of another task hears from that task
once: one token, made after all of them (``cross_controls``).

The pair meets in a rendezvous under ``src_device;dst_device;tensor;step_id``; the step
id is the only part that changes between steps, so partitions are built once per step
signature and reused.
"""

from __future__ import annotations

import numpy as np

from flowmill.kernels.sendrecv import key_prefix

from . import dtypes
from .device_names import host_of, task_of
from .step_graph import Node, Ref, StepGraph, loop_context, maybe_dead, topological_order

# Constants up to this size are copied into each partition that reads them; bigger ones
# travel once per step as any other tensor (a partition's graph ships once, but a big
# constant copied to every task would be held by every task).
DUPLICATE_CONST_BYTES = 16 << 10


class PartitionError(ValueError):
    pass


def _joins(step: StepGraph) -> set[Node]:
    """The step's joins: ``NoOp``s that nothing in the step reads or waits on (a
    ``group()`` run as a target, a train op). A join's control edges from other tasks
    need no message: each op it waits on is made a target of its own partition instead.
    A ``group()`` of every PS task's updates, run on a worker, then costs the step nothing
    beyond the updates themselves (TensorFlow sends a control tensor from each task)."""
    read = {src for n in step.nodes for src, _ in n.inputs}
    read.update(c for n in step.nodes for c in n.control)
    read.update(src for src, _ in step.fetches)
    return {n for n in step.nodes if n.type == "NoOp" and not n.frames and n not in read}


def _relays(order: list[Node], joins: set[Node], dead: set[Node]) -> dict[Node, str]:
    """``NoOp``s to run on another task than they were placed on, and that task's CPU: a
    ``NoOp`` outside loops and conditionals whose waiters (joins aside, which wait on
    nothing: see ``_joins``) are all on one task, when the edges cut with it there (one
    per task it waits on, other than that one) are fewer than where it is (the same,
    plus one to that task). ``order`` is topological; consumers are decided first, so a
    group of groups follows its waiters down the chain."""
    waiters: dict[Node, list[Node]] = {}
    for n in order:
        for c in n.control:
            waiters.setdefault(c, []).append(n)
    where: dict[Node, str] = {}

    def host(n: Node) -> str:
        return where.get(n) or host_of(n.device)

    for n in reversed(order):
        if n.type != "NoOp" or n.frames or n in dead or n in joins:
            continue
        if any(c in dead for c in n.control):  # it would carry a maybe-dead wait across
            continue
        hosts = {host(w) for w in waiters.get(n, ()) if w not in joins}
        here = host(n)
        if len(hosts) != 1 or here in hosts:
            continue
        there = hosts.pop()
        sources = {host(c) for c in n.control}
        if len(sources - {there}) < len(sources - {here}) + 1:
            where[n] = there
    return where


def answered_sends(part: StepGraph) -> tuple[str, list[str]] | None:
    """Where a run of ``part`` can answer with every value it sends: when it receives
    nothing (it runs to its end without waiting for a peer's value) and sends, outside
    loops, to one task only. Then the task they go to and their keys (less the step id),
    else None. Run by that task, the partition's answer carries the values, and the task
    takes them from it: one message instead of a pull's two, as TensorFlow's
    ``RunGraphResponse`` returns a partition's ``recv_key`` tensors. A PS task's partition
    that only reads (an evaluation, a sync worker's token) then costs one exchange. The
    partition's task and its client each work this out from the partition itself."""
    sends = [n for n in part.nodes if n.type == "_Send"]
    if not sends or any(n.type == "_Recv" for n in part.nodes) or any(n.frames for n in sends):
        return None
    to = {task_of(n.attrs["dst_device"]) for n in sends}
    if len(to) != 1 or None in to:
        return None
    return to.pop(), sorted(key_prefix(n.attrs) for n in sends)


def _duplicable(n: Node) -> bool:
    """A small constant that can be made wherever it is read."""
    return n.fixed_const and np.asarray(n.attrs["value"]).nbytes <= DUPLICATE_CONST_BYTES


def partition(step: StepGraph, client_device: str) -> dict[str, StepGraph]:
    """Split a placed step by task, each part keyed by its task's CPU device. The client's
    partition (always present) gets the feeds and the fetches; the others get targets
    only."""
    client_device = host_of(client_device)
    for n in step.feeds:
        if host_of(n.device) != client_device:
            raise PartitionError(f"feed {n.name} is on {n.device}, not the client {client_device}")
    return _Partitioner(step, client_device).run()


class _Partitioner:
    def __init__(self, step: StepGraph, client_device: str):
        self.step = step
        self.client_device = client_device
        self.order = topological_order(step.nodes)
        self.dead = maybe_dead(self.order)
        self.parts: dict[str, StepGraph] = {client_device: StepGraph([], [], [])}
        self.recvs: dict[tuple[Node, int, str], Node] = {}
        self.tokens: dict[tuple[Node, ...], Node] = {}

    def run(self) -> dict[str, StepGraph]:
        step, parts = self.step, self.parts
        joins = _joins(step)
        for n, device in _relays(self.order, joins, self.dead).items():
            n.device = device
        loop_device: dict = {}
        for n in step.nodes:
            ctx, part = loop_context(n), host_of(n.device)
            if ctx is not None and loop_device.setdefault(ctx, part) != part:
                raise PartitionError(
                    f"while loop {ctx.name!r} spans {loop_device[ctx]} and {part} "
                    f"({n.name}); keep a loop on one task"
                )
            parts.setdefault(part, StepGraph([], [], [])).nodes.append(n)
        for n in list(step.nodes):
            part = host_of(n.device)
            n.inputs = [self.cross(r, part) for r in n.inputs]
            control, remote = [], {}
            for c in n.control:
                if host_of(c.device) == part:
                    control.append(c)
                elif n in joins and not c.frames and c not in self.dead:
                    self.end_with_step(c)
                else:
                    remote.setdefault(host_of(c.device), []).append(c)
            control.extend(self.cross_controls(cs, n) for cs in remote.values())
            n.control = control
        client = parts[self.client_device]
        client.feeds = list(step.feeds)
        client.fetches = [self.cross(r, self.client_device) for r in step.fetches]
        for t in step.targets:
            parts[host_of(t.device)].targets.append(t)
        return parts

    def cross(self, ref: Ref, dst: str) -> Ref:
        """``ref`` readable in the partition of ``dst`` (a task's CPU device)."""
        src, i = ref
        here = host_of(src.device)
        if here == dst:
            return ref
        key = (src, i, dst)
        if key not in self.recvs and _duplicable(src):
            copy = Node("Const", f"{src.name}/_const/{dst}", dict(src.attrs), [], [], 1,
                        list(src.dtypes), list(src.shapes), device=dst)
            self.parts[dst].nodes.append(copy)
            self.recvs[key] = copy
        elif key not in self.recvs:
            attrs = {"tensor_name": f"{src.name}:{i}", "src_device": here, "dst_device": dst}
            send = Node("_Send", f"{src.name}/_send_{i}/{dst}", dict(attrs), [ref], [], 0,
                        device=here)
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
            self.parts[here].nodes.append(send)
            self.parts[here].targets.append(send)
            self.parts[dst].nodes.append(recv)
            self.recvs[key] = recv
        return (self.recvs[key], 0)

    def end_with_step(self, c: Node) -> None:
        """``c`` runs as a target of its own partition: a step ends only once every
        partition has run its targets, which is all a join waiting on ``c`` stood for."""
        targets = self.parts[host_of(c.device)].targets
        if c not in targets:
            targets.append(c)

    def cross_controls(self, cs: list[Node], n: Node) -> Node:
        """Control edges into ``n`` from ops ``cs`` of one other task cross as one scalar,
        produced there after all of them ran."""
        for c in cs:
            if c in self.dead:
                raise PartitionError(
                    f"{n.name} on {n.device} waits on {c.name} on {c.device}, which may not "
                    "run (it is on a conditional branch): keep conditional control edges on "
                    "one device"
                )
        key = tuple(cs)
        if key not in self.tokens:
            host = host_of(cs[0].device)
            if len(cs) == 1:
                name = f"{cs[0].name}/_control"
            else:
                job_task = task_of(host).strip("/").replace("/", "_").replace(":", "")
                name = f"{n.name}/_control_from_{job_task}"
            token = Node(
                "Const",
                name,
                {"value": np.zeros((), np.bool_), "dtype": dtypes.bool_},
                [],
                list(cs),
                1,
                [dtypes.bool_],
                [()],
                device=host,
            )
            self.parts[host].nodes.append(token)
            self.tokens[key] = token
        return self.cross((self.tokens[key], 0), host_of(n.device))[0]
