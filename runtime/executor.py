"""The executor: a pruned, optimized step compiled once into straight-line Python.

TensorFlow's executor walks pending-input counts and a ready queue on every step. Here the
schedule is decided once: nodes are put in topological order and emitted as one Python
function of plain kernel calls on local variables, so a repeated step pays only for the
calls. Control flow keeps its dataflow meaning: a Switch's untaken output is ``DEAD``,
nodes downstream of one test for it (and turn dead themselves), and a Merge takes its
first live input. A while-loop frame (Enter ... Exit) becomes a Python ``while`` around
its body's code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flowmill.kernels import DEAD, FRAME_KERNELS, KernelContext, get_builder, on_device
from flowmill.kernels.sendrecv import key_prefix

from . import trace
from .device_names import parse_device
from .gpu_memory import out_of_memory
from .step_graph import (
    Node,
    Ref,
    StepGraph,
    deps,
    is_back_edge,
    loop_role,
    maybe_dead,
    stable_toposort,
)

# Ops the compiler writes inline instead of calling a kernel for.
_INLINE_IDENTITY = frozenset({"Identity", "Enter", "Exit", "NextIteration", "StopGradient"})
# Producers whose outputs a consumer must never write into (shared with the caller or bound).
_NEVER_FORWARD = frozenset({"_Arg", "Const", "ReadVariableOp", "_Recv"})
# Ops that take a dead input like any other: a send (its receiver turns dead) and a stack
# push (its pop does: a cond branch not taken in one iteration of a loop).
_PASSES_DEAD = frozenset({"_Send", "StackPushV2"})
# Ops whose output is the same object every step (a constant, a state handle): bound once.
BOUND_ONCE = frozenset(
    {
        "Const",
        "VarHandleOp",
        "FIFOQueueV2",
        "ConditionalAccumulator",
        "SparseConditionalAccumulator",
        "StalenessClock",
    }
)


class Frame:
    """What frame kernels read: the step id, the rendezvous (``_Send``/``_Recv``), and the
    step's cancellation (kernels that wait on state), made only when one asks for it."""

    __slots__ = ("step_id", "rendezvous", "_cancellations")

    def __init__(self, step_id: int, rendezvous: Any, cancellations: Callable | None = None):
        self.step_id = step_id
        self.rendezvous = rendezvous
        self._cancellations = cancellations  # step id -> its Cancellation

    @property
    def cancellation(self):
        return None if self._cancellations is None else self._cancellations(self.step_id)

    def prefetch(self, prefixes: tuple[str, ...]) -> None:
        """Tell the rendezvous which keys this step will receive, in the order it needs
        them, before the first is asked for (a task's asks each peer once for all)."""
        prefetch = getattr(self.rendezvous, "prefetch", None)
        if prefetch is not None:
            prefetch(self.step_id, prefixes)


@dataclass
class Plan:
    """A compiled step: ``run(args, frame=None)`` returns the fetched values."""

    run: Callable[..., tuple]
    kernel_calls: int  # kernel invocations per step, loops counted once
    source: str
    order: list[Node]  # the nodes in the order compiled: kernel ``k<i>`` is ``order[i]``

    def failing_node(self, e: BaseException) -> Node | None:
        """The node whose kernel raised ``e`` inside this plan's step, if it was one."""
        line = None
        tb = e.__traceback__
        code = getattr(self.run, "__code__", None)
        while tb is not None:  # this plan's own frame: a kernel may run a plan of its own
            if tb.tb_frame.f_code is code:
                line = tb.tb_lineno
            tb = tb.tb_next
        lines = self.source.splitlines()
        if line is None or not 0 < line <= len(lines):
            return None
        m = _KERNEL_CALL.search(lines[line - 1])
        if m is None or int(m.group(1)) >= len(self.order):
            return None
        return self.order[int(m.group(1))]


def compile_step(step: StepGraph, resources: Any, device_type: str | None = None,
                 in_place_updates: bool = False) -> Plan:
    """Compile ``step``: each node's kernel for its own device (the CPU where it has none),
    or with ``device_type`` every kernel for that device type (constant folding runs on
    the host whatever a node asked for). ``in_place_updates``: for a step captured as a
    CUDA graph (``KernelContext.in_place_updates``)."""
    return _Compiler(step, resources, device_type, in_place_updates).compile()


_VALUE_NAME = re.compile(r"\b(?:v\d+_\d+|m\d+)\b")
_KERNEL_CALL = re.compile(r"\bk(\d+)\(")
_STEP_FILENAME = "<flowmill step>"


def _release_after_last_use(statements: list[list[str]], keep: set[str]) -> list[str]:
    """Set each step value to None after the last statement that reads it.

    Without this every intermediate lives until the step returns, and the allocator
    gives the whole batch of freed buffers back to the OS at once, only to fault the
    pages in again next step; released early, a buffer is reused within the step.
    """
    last_use = {}
    for i, lines in enumerate(statements):
        for name in _VALUE_NAME.findall("\n".join(lines)):
            last_use[name] = i
    dead_after: dict[int, list[str]] = {}
    for name, i in last_use.items():
        if name not in keep:
            dead_after.setdefault(i, []).append(name)
    body: list[str] = []
    for i, lines in enumerate(statements):
        body.extend(lines)
        if i in dead_after:
            body.append("  " + " = ".join(sorted(dead_after[i])) + " = None")
    return body


def _schedule(nodes: list[Node]) -> list[Node]:
    """The order the step's code runs its nodes in: topological, and an op that may wait on
    another task or thread (a ``_Recv``, a queue's dequeue, an accumulator's take: every
    frame kernel but ``_Send``) only once nothing else is ready. The step runs straight
    through, so a wait placed early holds back every op after it, among them ones another
    task may be waiting for (a value to send, an update that completes a round).
    TensorFlow's executor runs every ready op, so a wait there holds back only its
    own consumers. Ops inside loops keep their place."""
    return stable_toposort(
        nodes,
        lambda n: (src for src in deps(n) if not is_back_edge(n, src)),
        last=lambda n: not n.frames and n.type in FRAME_KERNELS and n.type != "_Send",
    )


def _defer_reads(order: list[Node]) -> list[Node]:
    """Move each variable read to just before the first node that needs it.

    A read holds the variable's buffer from the moment it runs; held early (say, while the
    step waits on a Recv), it makes every concurrent update of that variable copy the whole
    buffer (updates are copy-on-write). Read late, it also sees the newest value. The
    numerics checks of a read move with it."""
    read_of: dict[Node, Node] = {n: n for n in order if n.type == "ReadVariableOp" and not n.frames}
    checks: dict[Node, list[Node]] = {}
    for n in order:
        if n.type == "CheckNumerics" and n.inputs[0][0] in read_of:
            read_of[n] = n.inputs[0][0]
            checks.setdefault(n.inputs[0][0], []).append(n)
    first_use: dict[Node, int] = {}
    for i, n in enumerate(order):
        for src in deps(n):
            read = read_of.get(src)
            if read is not None and read_of.get(n) is not read:
                first_use.setdefault(read, i)
    deferred: dict[int, list[Node]] = {}
    for n in order:
        if n.type == "ReadVariableOp" and not n.frames and n in first_use:
            deferred.setdefault(first_use[n], []).extend([n, *checks.get(n, ())])
    if not deferred:
        return order
    moved = {n for reads in deferred.values() for n in reads}
    out: list[Node] = []
    for i, n in enumerate(order):
        out.extend(deferred.get(i, ()))
        if n not in moved:
            out.append(n)
    return out


class _Compiler:
    def __init__(self, step: StepGraph, resources, device_type: str | None,
                 in_place_updates: bool = False):
        self.in_place_updates = in_place_updates
        self.step = step
        self.resources = resources
        self.device_type = device_type
        self.order = _defer_reads(_schedule(step.nodes))
        self.index = {n: i for i, n in enumerate(self.order)}
        self.bindings: dict[str, Any] = {"DEAD": DEAD}
        self.kernel_calls = 0
        self.maybe_dead = maybe_dead(self.order)
        self.forwardable = self._find_forwardable()
        self.used = {src for n in self.order for src, _ in n.inputs}
        self.used.update(src for src, _ in step.fetches)
        self.merge_of_next = {
            src: m
            for m in self.order
            if m.type == "Merge"
            for src, _ in m.inputs
            if src.type == "NextIteration"
        }
        self.needs_liveness = {
            c for n in self.order for c in n.control if c in self.maybe_dead and c.num_outputs == 0
        }

    def _find_forwardable(self) -> dict[Node, tuple[bool, ...]]:
        """Inputs read exactly once in the step, by a top-level node that always runs: the
        consuming kernel may write into them (it still checks nobody else holds them)."""
        uses: dict[Ref, int] = {}
        for n in self.order:
            # A CheckNumerics reads only the shapes of its inputs after the first.
            for r in n.inputs[:1] if n.type == "CheckNumerics" else n.inputs:
                uses[r] = uses.get(r, 0) + 1
        for r in self.step.fetches:
            uses[r] = uses.get(r, 0) + 1
        return {
            n: tuple(uses[r] == 1 and r[0].type not in _NEVER_FORWARD for r in n.inputs)
            for n in self.order
            if not n.frames and n not in self.maybe_dead
        }

    # ---- naming
    def var(self, ref: Ref) -> str:
        node, i = ref
        return f"v{self.index[node]}_{i}"

    def outs(self, node: Node) -> list[str]:
        k = self.index[node]
        return [f"v{k}_{i}" for i in range(max(node.num_outputs, 1))]

    # ---- analysis
    def _loop_role(self, n: Node) -> str | None:
        return loop_role(n)

    # ---- emission
    def compile(self) -> Plan:
        statements: list[list[str]] = []  # top-level statements (a loop is one)
        # Every value the step will surely receive from the rendezvous, announced first:
        # a remote rendezvous asks each peer once for all of them.
        recvs = tuple(key_prefix(n.attrs) for n in self.order
                      if n.type == "_Recv" and not n.frames and n not in self.maybe_dead)
        if len(recvs) > 1:
            self.bindings["_RECV_KEYS"] = recvs
            statements.append(["  if frame is not None: frame.prefetch(_RECV_KEYS)"])
        self._emit_block((), self.order, statements, 1)
        fetches = ", ".join(self.var(r) for r in self.step.fetches)
        body = _release_after_last_use(statements, keep=set(_VALUE_NAME.findall(fetches)))
        body.append(f"  return ({fetches}{',' if len(self.step.fetches) == 1 else ''})")
        # A kernel that cannot allocate fails the step naming itself, its device and the
        # memory limit (a try costs nothing until something raises).
        src = ("def step(args, frame=None):\n  try:\n" + "\n".join("  " + s for s in body)
               + "\n  except MemoryError as e:\n    raise _oom(_PLAN.failing_node(e), e) from e\n")
        # Kernels and constants are the function's globals: CPython's specialized global
        # loads are cheaper than closure cells, and dispatch is the cost that matters here.
        namespace: dict[str, Any] = dict(self.bindings)
        exec(compile(src, _STEP_FILENAME, "exec"), namespace)
        plan = Plan(namespace["step"], self.kernel_calls, src, self.order)
        namespace["_PLAN"], namespace["_oom"] = plan, out_of_memory
        return plan

    def _emit_block(self, path: tuple, nodes: list[Node], out: list[str], depth: int) -> None:
        """Emit ``nodes`` (all inside loop ``path``), a nested loop as one unit."""
        units: list[Any] = []
        members: dict[Any, list[Node]] = {}
        unit_of: dict[Node, Any] = {}
        for n in nodes:
            p = n.frames
            unit = n if len(p) == len(path) else p[len(path)]
            if unit not in members:
                members[unit] = []
                units.append(unit)
            members[unit].append(n)
            unit_of[n] = unit

        # Order units so each comes after what it reads (a loop reads its Enter inputs).
        def unit_deps(u):
            for n in members[u]:
                for src in deps(n):
                    if src in unit_of and not is_back_edge(n, src):
                        yield unit_of[src]

        if len(units) == len(nodes):  # no nested loop: ``nodes`` is already in order
            ordered = units
        else:
            ordered = stable_toposort(units, unit_deps)
        for u in ordered:
            # At the top level ``out`` collects one list of lines per statement.
            lines: list[str] = [] if depth == 1 else out
            if isinstance(u, Node):
                self._emit_node(u, lines, depth)
            else:
                self._emit_loop(path + (u,), members[u], lines, depth)
            if depth == 1 and lines:
                out.append(lines)

    def _emit_loop(self, path: tuple, nodes: list[Node], out: list[str], depth: int) -> None:
        pad = "  " * depth
        # Nodes of this frame itself, not of a loop nested in it, hold its merges and switches.
        own = [n for n in nodes if n.frames == path]
        # A loop in a cond branch not taken is entered with dead values: it does not run,
        # and its exits (read off its switches) are dead.
        entered = [
            self.var(n.inputs[0])
            for n in own
            if n.loop_role in ("enter", "enter_const") and n.inputs[0][0] in self.maybe_dead
        ]
        if entered:
            switches = [self.outs(n)[0] for n in own if n.loop_role == "switch"]
            out.append(f"{pad}if {' or '.join(f'{v} is DEAD' for v in entered)}:")
            out.append(f"{pad}  {' = '.join(switches)} = DEAD")
            out.append(f"{pad}else:")
            depth += 1
            pad += "  "
        merges = [n for n in own if n.loop_role == "merge"]
        carried = {}
        for m in merges:
            enter, _ = m.inputs[0]
            carried[m] = f"m{self.index[m]}"
            # The Enter feeding a Merge is emitted inside the loop block; read its input here.
            out.append(f"{pad}{carried[m]} = {self.var(enter.inputs[0])}")
        out.append(f"{pad}while True:")
        inner: list[str] = []
        ipad = pad + "  "
        for m in merges:
            v0, v1 = self.outs(m)
            inner.append(f"{ipad}{v0} = {carried[m]}")
        rest = [n for n in nodes if n not in carried]
        self._emit_block(path, rest, inner, depth + 1)
        out.extend(inner)
        # After the loop the Switches' false outputs hold the final values, for the Exits.
        for n in own:
            if n.loop_role == "switch":
                merge = n.inputs[0][0]
                out.append(f"{pad}{self.outs(n)[0]} = {self.outs(merge)[0]}")

    def _emit_node(self, n: Node, out: list[str], depth: int) -> None:
        pad = "  " * depth
        outs = self.outs(n)
        ins = [self.var(r) for r in n.inputs]
        role = self._loop_role(n)
        if n.type == "_Arg":
            out.append(f"{pad}{outs[0]} = args[{n.attrs['index']}]")
            return
        if role == "merge":
            return  # written by _emit_loop
        if role == "loop_cond":
            out.append(f"{pad}{outs[0]} = {ins[0]}")
            out.append(f"{pad}if not {outs[0]}: break")
            return
        if role == "switch":
            out.append(f"{pad}{outs[0]} = DEAD; {outs[1]} = {ins[0]}")
            return
        if role == "next":
            out.append(f"{pad}m{self.index[self.merge_of_next[n]]} = {ins[0]}")
            return
        if n.type in _INLINE_IDENTITY:
            out.append(f"{pad}{outs[0]} = {ins[0]}")
            return
        if n.type == "Merge":
            self._emit_merge(n, outs, ins, out, pad)
            return
        if n.type in BOUND_ONCE:
            name = f"c{self.index[n]}"
            self.bindings[name] = self._build(n)()
            # Still tested below: a constant in a cond branch waits on the branch's pivot,
            # and must be dead when the branch is not taken.
            stmt = f"{outs[0]} = {name}"
        else:
            kname = f"k{self.index[n]}"
            self.bindings[kname] = self._build(n)
            if trace.TRACER is not None:
                self.bindings[kname] = trace.TRACER.wrap(self.bindings[kname], n.name, n.type)
            self.kernel_calls += 1
            call = f"{kname}({', '.join((['frame'] if n.type in FRAME_KERNELS else []) + ins)})"
            if n.num_outputs == 0:
                stmt = call if n not in self.needs_liveness else f"{call}; {outs[0]} = None"
            elif n.num_outputs == 1:
                stmt = f"{outs[0]} = {call}"
            else:
                stmt = f"{', '.join(outs)}, = {call}"
        dead_inputs = [self.var(r) for r in n.inputs if r[0] in self.maybe_dead]
        dead_inputs += [self.outs(c)[0] for c in n.control if c in self.maybe_dead]
        if not dead_inputs or n.type in _PASSES_DEAD:
            out.append(pad + stmt)
            return
        test = " or ".join(f"{v} is DEAD" for v in dict.fromkeys(dead_inputs))
        out.append(f"{pad}if {test}:")
        out.append(f"{pad}  {' = '.join(outs)} = DEAD")
        out.append(f"{pad}else:")
        out.append(f"{pad}  {stmt}")

    def _emit_merge(self, n: Node, outs, ins, out, pad) -> None:
        for i, v in enumerate(ins):
            kw = "if" if i == 0 else "elif"
            out.append(f"{pad}{kw} {v} is not DEAD:")
            out.append(f"{pad}  {outs[0]} = {v}; {outs[1]} = {i}")
        out.append(f"{pad}else:")
        out.append(f"{pad}  {outs[0]} = {outs[1]} = DEAD")

    def _build(self, n: Node):
        kind, ordinal = self.device_type or "CPU", 0
        if n.device and self.device_type is None:
            kind, _, index = parse_device(n.device).get("device", "CPU:0").partition(":")
            ordinal = int(index or 0)
        builder = get_builder(n.type, kind)
        ctx = KernelContext(
            op_type=n.type,
            name=n.name,
            attrs=n.attrs,
            device_type=kind,
            resources=self.resources,
            input_dtypes=[src.dtypes[i] for src, i in n.inputs],
            output_dtypes=list(n.dtypes),
            output_shapes=list(n.shapes),
            outputs_used=n in self.used,
            forwardable=self.forwardable.get(n, ()),
            in_place_updates=self.in_place_updates,
        )
        try:
            if ordinal:
                return on_device(on_device(builder, kind, ordinal)(ctx), kind, ordinal)
            return builder(ctx)
        except Exception as e:  # name the op whose kernel could not be set up
            raise type(e)(f"op {n.name!r} ({n.type}): {e}") from e
