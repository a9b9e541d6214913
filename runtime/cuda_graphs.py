"""CUDA graph replay (``Session(cuda_graphs=True)``): the parts of a step that can be
captured run as CUDA graphs, captured once per shape of what they read, then replayed as
one launch each; the rest of the step runs as it always does.

Which parts (``cuda_graph_segments``): a segment is a set of kernels on the step's one GPU
with no host synchronization among them, outside loops and conditionals. A host node
that depends on a feed or on state (a ``Print`` of a device value, a ``_Send``), a read
back to the host in the middle of the step, or a ``_Recv`` ends one segment and starts
the next; a step with none of these is one segment, one launch. A segment that would
launch fewer than two kernels stays eager: its launch and the copies around it would cost
what they save. Each segment becomes one ``_CudaGraphSegment`` node of the step, whose
kernel is its ``SegmentRunner``.

A captured graph keeps the device pointers its kernels were given, so what it reads and
writes must stay where it was at capture:

- what a segment reads from the rest of the step is copied, before each launch, into
  device buffers made at capture: host values uploaded into them, device values copied
  on the device;
- variables are updated in their own buffers (the segment is compiled with
  ``in_place_updates``, and a variable the graph touches stays fixed there: copy-on-write
  updates by other steps would leave the graph a stale buffer);
- each value the rest of the step reads of it is copied on the device where it is made
  (``_DeviceCopy``: a variable read before the graph updates it is that read's value);
  after the launch it is downloaded, or copied again for the step to own (the graph
  writes its buffers again at its next launch, maybe while a value of this step is still
  held);
- the graph's buffers come from a memory pool of its own, kept with it: blocks of the
  shared pool, freed after the capture, would be handed to other arrays while the graph
  still writes them at each launch (PyTorch keeps a private pool per graph for the same
  reason).

Per segment and per shape of its inputs, the first run is an ordinary one (it makes
CuPy's BLAS handles and compiles its kernels, which a capture cannot do); the second runs
the segment to be captured, in its own pool and on the capture stream (the pool then holds
every block the capture will ask for: no allocation from the driver happens under
capture); the third captures and launches; the rest launch. Where a capture fails (a
kernel that reads back to the host, a library call a capture cannot hold) that segment
runs as ordinary code from then on, said once; the others still replay. Without a GPU
module that can capture, the option changes nothing.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np

from .cuda_graph_segments import Segment, contract, find_segments, segment_step, the_gpu
from .executor import Plan, compile_step
from .step_graph import Node, StepGraph

log = logging.getLogger("flowmill.cuda_graphs")

WARM = "warm"  # a shape seen once: its next run is the one to capture, in its own pool


@dataclass
class _Replay:
    pool: object  # the graph's own memory pool
    inputs: list  # per input, its buffer (or the host value it takes as it is)
    graph: object = None  # once captured
    outputs: tuple = ()


class SegmentRunner:
    """The kernel of a ``_CudaGraphSegment`` node: ``runner(*inputs)`` gives the segment's
    outputs (one value, a tuple of them, or None), run eagerly or replayed."""

    def __init__(self, segment: Segment, eager: Plan, captured: Plan, originals: dict,
                 xp, stream):
        self.segment = segment
        self.eager = eager
        self.captured = captured
        self.originals = originals  # a node of the segment's own steps -> the step's node
        self.xp = xp
        self.stream = stream
        self.uploads = tuple(kind == "upload" for kind, _ in segment.inputs)
        self.kinds = tuple(segment.output_kind(k) for k in range(len(segment.outputs)))
        self.replays: dict = {}  # input shapes -> WARM or _Replay
        self.failed: str | None = None  # why the segment runs eagerly for good
        self.lock = threading.Lock()

    def __call__(self, *inputs):
        if self.failed is not None:
            return self._result(self.eager.run(inputs))
        key = tuple(self._key(v, up) for v, up in zip(inputs, self.uploads, strict=True))
        with self.lock:
            replay = self.replays.get(key)
            if replay is None:
                self.replays[key] = WARM
                return self._result(self.eager.run(inputs))
            if replay is WARM:
                return self._result(self._warm(key, inputs))
            self._fill(replay, inputs)
            if replay.graph is None and not self._capture(replay):
                return self._result(self.eager.run(inputs))
            replay.graph.launch(self.xp.cuda.get_current_stream())
            return self._result(self._hand_out(replay.outputs))

    def _key(self, value, upload: bool) -> tuple:
        if upload:
            value = np.asarray(value)
            return (value.shape, value.dtype.str)
        if isinstance(value, self.xp.ndarray):
            return (value.shape, value.dtype.str)
        if isinstance(value, (np.ndarray, np.generic, int, float, bool, tuple)):
            host = np.asarray(value)  # a shape, an axis: the graph is captured with it
            return ("host", host.shape, host.dtype.str, host.tobytes())
        return ("object", id(value))  # a handle, made once

    def _warm(self, key, inputs: tuple) -> tuple:
        """The run before the capture, in the graph's own pool, on its stream."""
        xp = self.xp
        xp.cuda.get_current_stream().synchronize()  # the inputs are made on that stream
        pool = xp.cuda.MemoryPool()
        with xp.cuda.using_allocator(pool.malloc), self.stream:
            buffers = [self._buffer(v, up) for v, up in zip(inputs, self.uploads, strict=True)]
            values = self.captured.run(tuple(buffers))
            self.stream.synchronize()
        self.replays[key] = _Replay(pool, buffers)
        return self._hand_out(values)

    def _buffer(self, value, upload: bool):
        if upload:
            return self.xp.asarray(np.asarray(value))
        if isinstance(value, self.xp.ndarray):
            return value.copy()
        return value

    def _fill(self, replay: _Replay, inputs: tuple) -> None:
        for buffer, value, upload in zip(replay.inputs, inputs, self.uploads, strict=True):
            if upload:
                buffer.set(np.asarray(value))
            elif buffer is not value and isinstance(buffer, self.xp.ndarray):
                self.xp.copyto(buffer, value)

    def _capture(self, replay: _Replay) -> bool:
        stream = self.stream
        try:
            with self.xp.cuda.using_allocator(replay.pool.malloc), stream:
                stream.begin_capture()
                try:
                    outputs = self.captured.run(tuple(replay.inputs))
                finally:
                    graph = stream.end_capture()
        except Exception as e:  # noqa: BLE001 - any failure: this segment runs eagerly
            self.failed = str(e)
            self.replays.clear()
            log.warning("%s runs eagerly: its capture as a CUDA graph failed: %s",
                        self.describe(), e)
            return False
        replay.graph, replay.outputs = graph, outputs
        return True

    def _hand_out(self, values: tuple) -> tuple:
        """The outputs as the rest of the step may keep them: in host memory, or copies."""
        out = []
        for value, kind in zip(values, self.kinds, strict=True):
            if kind == "download":
                out.append(value.get())
            elif hasattr(value, "copy"):
                out.append(value.copy())
            else:
                out.append(value)
        return tuple(out)

    def _result(self, values: tuple):
        if len(values) == 1:
            return values[0]
        return values or None

    def describe(self) -> str:
        nodes = self.segment.nodes
        return f"{self.segment.name} ({len(nodes)} nodes, {nodes[0].name} .. {nodes[-1].name})"

    def failing_node(self, e: BaseException) -> Node | None:
        """The step's node whose kernel raised ``e`` inside this segment, if known."""
        node = self.eager.failing_node(e) or self.captured.failing_node(e)
        return self.originals.get(node)


class GraphedPlan:
    """A step whose segments run as CUDA graphs; ``run(args, frame)`` as ``Plan.run``."""

    def __init__(self, plan: Plan, runners: list[SegmentRunner]):
        self.plan = plan
        self.runners = runners
        self.run = plan.run

    def __getattr__(self, name: str):  # the plan's order, source, kernel_calls, ...
        return getattr(self.plan, name)

    @property
    def replays(self) -> dict:
        """Every segment's graphs, by (segment, input shapes)."""
        return {(r.segment.name, key): replay for r in self.runners
                for key, replay in r.replays.items()}

    def failing_node(self, e: BaseException) -> Node | None:
        node = self.plan.failing_node(e)
        runner = node.attrs.get("runner") if node is not None else None
        if isinstance(runner, SegmentRunner):
            return runner.failing_node(e) or node
        return node


def graphed(step: StepGraph, eager: Plan, resources, xp) -> GraphedPlan | Plan:
    """``eager`` (compiled from ``step``: placed, copies in, fused) with the segments of
    ``step`` that can be captured made CUDA graphs, or ``eager`` itself where none can
    (said once, with why)."""
    gpu, reason = the_gpu(step)
    if reason is None and not hasattr(getattr(xp, "cuda", None), "Stream"):
        reason = "the GPU module cannot capture streams"
    if gpu is None or reason is not None:
        log.info("a step runs eagerly, not as CUDA graphs: %s", reason)
        return eager
    segments, outside = find_segments(step, gpu)
    if not segments:
        log.info("a step runs eagerly, not as CUDA graphs: %s", _reasons(outside))
        return eager
    stream = xp.cuda.Stream(non_blocking=True)
    runners, nodes = [], []
    for seg in segments:
        own, originals = segment_step(seg, captured=False)
        captured, captured_originals = segment_step(seg, captured=True)
        runner = SegmentRunner(
            seg, compile_step(own, resources),
            compile_step(captured, resources, in_place_updates=True),
            {**originals, **captured_originals}, xp, stream)
        runners.append(runner)
        nodes.append(Node(
            "_CudaGraphSegment", seg.name, {"runner": runner}, [r for _, r in seg.inputs],
            list(seg.control), len(seg.outputs), [n.dtypes[i] for n, i in seg.outputs],
            [n.shapes[i] for n, i in seg.outputs], device=gpu))
    plan = compile_step(contract(step, segments, nodes), resources)
    if outside:
        log.info("a step runs as %d CUDA graph segment(s); outside them: %s",
                 len(segments), _reasons(outside))
    return GraphedPlan(plan, runners)


def _reasons(outside: dict[Node, str]) -> str:
    """Each reason once, with the first node it holds for."""
    first: dict[str, Node] = {}
    for n, why in outside.items():
        first.setdefault(why, n)
    return "; ".join(f"{n.name} ({n.type}) {why}" for why, n in first.items())
