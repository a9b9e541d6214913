"""CUDA graph replay: a step captured once per shape of its feeds, then replayed as one
launch (``Session(cuda_graphs=True)``).

A captured graph keeps the device pointers its kernels were given, so what it reads and
writes must stay where it was at capture:

- the feeds are copied, before each launch, into device buffers made at capture;
- variables are updated in their own buffers (the step is compiled with
  ``in_place_updates``, and a variable the graph touches stays fixed there: copy-on-write
  updates by other steps would leave the graph a stale buffer);
- each fetched value is copied on the device where it is made (``_DeviceCopy``), then
  downloaded after the launch.

- the graph's buffers (its feeds', its intermediates') come from a memory pool of its
  own, kept with it: blocks of the shared pool, freed after the capture, would be handed
  to other arrays while the graph still writes them at each launch (PyTorch keeps a
  private pool per graph for the same reason).

Nothing may synchronize with the host inside: a step qualifies only when every node runs
on one GPU, but for the feeds and their uploads, the fetches' downloads, and host nodes
that depend on no feed and no state (shapes, constants: their values are the same at
every launch). Loops and conditionals do not qualify (their predicates are read on the
host). Per feed shape, the first run is an ordinary step (it makes CuPy's BLAS handles
and compiles its kernels, which a capture cannot do); the second runs the step to be
captured, in its own pool (which then holds every block the capture will ask for: no
allocation from the driver happens under capture); the third captures and launches; the
rest launch. Where a capture fails (a kernel that reads back to the host, a library call
a capture cannot hold) the step runs as an ordinary step from then on, said once. Without
a GPU module that can capture, the option changes nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from dataclasses import dataclass, field

from .device_names import device_type
from .executor import Plan, compile_step
from .step_graph import Node, StepGraph, topological_order

log = logging.getLogger("flowmill.cuda_graphs")


def why_not(step: StepGraph) -> str | None:
    """Why ``step`` (placed, with its copies in) cannot be captured; None if it can."""
    gpus = {n.device for n in step.nodes if n.device and device_type(n.device) != "CPU"}
    if len(gpus) != 1:
        return "it runs on no GPU" if not gpus else f"it spans {len(gpus)} GPUs"
    fed: set[Node] = set()  # host nodes that depend on a feed or on state
    for n in topological_order(step.nodes):
        if n.frames or n.in_control_flow:
            return f"{n.name} ({n.type}) is in a loop or a conditional"
        if n.device in gpus:
            continue
        if n.type == "_Arg" or n.stateful or any(src in fed for src, _ in n.inputs):
            fed.add(n)
    fetched = {src for src, _ in step.fetches}
    for n in step.nodes:
        if n in fed and n.type != "_Arg":
            return f"{n.name} ({n.type}) runs on the host and depends on a feed or on state"
        if n.type == "_HostToDevice" and n.inputs[0][0].type != "_Arg":
            return f"{n.name} copies a host value to the GPU inside the step"
        if n.type == "_DeviceToHost" and n not in fetched:
            return f"{n.name} reads a value back to the host inside the step"
    return None


def _clone(step: StepGraph) -> StepGraph:
    """A copy of ``step`` whose nodes can be changed without touching ``step``'s."""
    new = {n: dataclasses.replace(n) for n in step.nodes}

    def ref(r):
        return (new.get(r[0], r[0]), r[1])

    for n in new.values():
        n.inputs = [ref(r) for r in n.inputs]
        n.control = [new.get(c, c) for c in n.control]
    return StepGraph([new[n] for n in step.nodes], [ref(r) for r in step.fetches],
                     [new.get(t, t) for t in step.targets], [new.get(f, f) for f in step.feeds])


def body(step: StepGraph) -> StepGraph:
    """The captured part of ``step``: its feeds arrive on the device (their uploads are
    done before the launch), and its fetches are device snapshots (downloaded after)."""
    uploads = {n: n.inputs[0] for n in step.nodes
               if n.type == "_HostToDevice" and n.inputs[0][0].type == "_Arg"}
    for n in step.nodes:
        if n.type == "_DeviceToHost":  # only fetches qualify: see why_not
            n.type, n.attrs = "_DeviceCopy", {}
    for n in step.nodes:
        n.inputs = [uploads[src] if src in uploads else (src, i) for src, i in n.inputs]
    step.nodes = [n for n in step.nodes if n not in uploads]
    step.fetches = [uploads[src] if src in uploads else (src, i) for src, i in step.fetches]
    return step


@dataclass
class _Replay:
    pool: object  # the graph's own memory pool
    inputs: list  # its feeds' buffers
    graph: object = None  # once captured
    outputs: tuple = ()


@dataclass
class GraphedPlan:
    """``run(args)`` as ``Plan.run``: eager, then captured, then replayed, per feed shape."""

    eager: Plan
    captured: Plan
    xp: object
    stream: object
    replays: dict = field(default_factory=dict)  # feed shapes -> _Replay, or "warm"/"eager"
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __getattr__(self, name: str):  # the plan's order, source, failing_node, ...
        return getattr(self.eager, name)

    def run(self, args: tuple, frame=None) -> tuple:
        key = tuple((a.shape, a.dtype.str) for a in args)
        with self.lock:
            state = self.replays.get(key)
            if state is None or state == "eager":
                self.replays.setdefault(key, "warm")
                return self.eager.run(args, frame)
            if state == "warm":  # the step to be captured, run in the graph's own pool
                pool = self.xp.cuda.MemoryPool()
                with self.xp.cuda.using_allocator(pool.malloc):
                    state = _Replay(pool, [self.xp.asarray(a) for a in args])
                    values = self.captured.run(tuple(state.inputs))
                self.replays[key] = state
                return _host(values)
            for buffer, value in zip(state.inputs, args, strict=True):
                buffer.set(value)
            if state.graph is None and not self._capture(key, state):
                return self.eager.run(args, frame)
            state.graph.launch(self.stream)
            self.stream.synchronize()
            return _host(state.outputs)

    def _capture(self, key, replay: _Replay) -> bool:
        stream = self.stream
        try:
            with self.xp.cuda.using_allocator(replay.pool.malloc), stream:
                stream.begin_capture()
                try:
                    outputs = self.captured.run(tuple(replay.inputs))
                finally:
                    graph = stream.end_capture()
        except Exception as e:  # noqa: BLE001 - any failure: this feed shape runs eagerly
            self.replays[key] = "eager"
            log.warning("a step runs eagerly: its capture as a CUDA graph failed: %s", e)
            return False
        replay.graph, replay.outputs = graph, outputs
        return True


def _host(values: tuple) -> tuple:
    return tuple(v.get() if hasattr(v, "get") else v for v in values)


def graphed(step: StepGraph, eager: Plan, resources, xp) -> GraphedPlan | Plan:
    """``eager`` (compiled from ``step``: placed, copies in, fused) wrapped to be captured
    and replayed, or ``eager`` itself where ``step`` cannot be captured, said once."""
    reason = why_not(step)
    if reason is None and not hasattr(getattr(xp, "cuda", None), "Stream"):
        reason = "the GPU module cannot capture streams"
    if reason is not None:
        log.info("a step runs eagerly, not as a CUDA graph: %s", reason)
        return eager
    captured = compile_step(body(_clone(step)), resources, in_place_updates=True)
    return GraphedPlan(eager, captured, xp, xp.cuda.Stream(non_blocking=True))
