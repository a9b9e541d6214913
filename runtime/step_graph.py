"""The step graph: the compile-time form of one step, and the graph algorithms over it.

``prune`` makes a ``StepGraph`` from the user's graph (its ``Node``s carry what a step
needs of each op: type, attrs, inputs, device, control-flow frames), and every later step
works on that one structure: the passes rewrite it, placement sets devices, partition
splits it per device, ``graph_def`` ships a partition to another task, and the executor
compiles it. The orders they share live here: a stable topological order (loop back edges
left out), which nodes may carry a dead value, and which while-loop frame a node runs in.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .op_def import OPS, OpDef

if TYPE_CHECKING:
    from .graph import Operation

Ref = tuple["Node", int]  # (producer, output index)


@dataclass(eq=False)
class Node:
    type: str
    name: str
    attrs: dict[str, Any]
    inputs: list[Ref]
    control: list[Node]
    num_outputs: int
    dtypes: list = field(default_factory=list)  # per output
    shapes: list = field(default_factory=list)  # per output
    op: Operation | None = None  # None for nodes a pass made, or rebuilt from a GraphDef
    device: str = ""
    # Control-flow structure, carried on the node itself so a step rebuilt without its
    # Operations (shipped to another task) compiles the same: the names of the while-loop
    # frames around the node (outermost first; a loop's name is its unique name scope),
    # its part in its innermost loop's frame ("enter", "merge", "switch", ...), and
    # whether it was built in any cond branch or loop body.
    frames: tuple[str, ...] = ()
    loop_role: str | None = None
    in_control_flow: bool = False

    @property
    def op_def(self) -> OpDef:
        return OPS[self.type]

    @property
    def stateful(self) -> bool:
        return self.type != "_Arg" and self.op_def.stateful

    @property
    def fixed_const(self) -> bool:
        """A Const whose value is there whenever the step runs, so a pass may fold it or
        copy it. One in a cond branch or a loop body is not: it waits on the branch's or
        the body's pivot (folding it would run a loop frame without its condition,
        forever), and one under control dependencies waits on them."""
        return (self.type == "Const" and not self.in_control_flow and not self.frames
                and not self.control)

    def __repr__(self) -> str:
        return f"<Node {self.name} {self.type}>"


@dataclass
class StepGraph:
    nodes: list[Node]  # every node the step needs, in creation order
    fetches: list[Ref]
    targets: list[Node]
    feeds: list[Node] = field(default_factory=list)  # the _Arg nodes, in feed order


def deps(n: Node) -> list[Node]:
    return [src for src, _ in n.inputs] + n.control


@dataclass(frozen=True)
class LoopFrame:
    """A while loop's frame, known by name: a loop's name is its unique name scope, so
    the same frame is found in a step rebuilt from a GraphDef, without its Operations."""

    path: tuple[str, ...]  # the enclosing frames' names, outermost first, then this one's

    @property
    def name(self) -> str:
        return self.path[-1]


def loop_context(node: Node) -> LoopFrame | None:
    """The innermost while-loop frame a node runs in, or None."""
    return LoopFrame(node.frames) if node.frames else None


def loop_role(n: Node) -> str | None:
    """What a node does in its while loop's frame (merge, switch, ...), or None."""
    return n.loop_role


def maybe_dead(order: list[Node]) -> set[Node]:
    """Nodes (in topological ``order``) whose outputs can be DEAD: downstream of a
    conditional Switch, a ``_Recv`` (a stack pop) whose sender (pusher) can be, or the
    Exit of a loop that may be entered with a dead value."""
    dead: set[Node] = set()
    dead_frames: set[tuple[str, ...]] = set()  # loops entered from a cond branch
    for n in order:
        if n.type == "Switch" and not loop_role(n):
            dead.add(n)
        elif loop_role(n) in ("enter", "enter_const"):
            # A loop entered with a dead value does not run; its Exits are dead. Inside
            # it nothing is: a loop that runs was entered with live values.
            if any(src in dead for src in deps(n)):
                dead_frames.add(n.frames)
        elif n.type == "Exit":
            if n.inputs[0][0].frames in dead_frames:
                dead.add(n)
        elif n.type in ("_Recv", "StackPopV2") and n.attrs["may_be_dead"]:
            dead.add(n)
        elif n.type == "Merge":
            if not loop_role(n) and all(src in dead for src, _ in n.inputs):
                dead.add(n)
        elif any(src in dead for src in deps(n)):
            dead.add(n)
    return dead


def is_back_edge(dst: Node, src: Node) -> bool:
    return dst.type == "Merge" and src.type == "NextIteration"


def stable_toposort(items: list, deps: Callable[[Any], Iterable[Any]],
                    last: Callable[[Any], bool] | None = None) -> list:
    """Kahn's algorithm; of the items ready at once, the earliest in ``items`` goes first,
    except that an item ``last`` says yes to goes only when no other item is ready."""
    position = {item: i for i, item in enumerate(items)}
    pending = dict.fromkeys(items, 0)
    users: dict[Any, list] = {item: [] for item in items}
    for item in items:
        for src in set(deps(item)):
            if src in position and src is not item:
                pending[item] += 1
                users[src].append(item)
    def key(item) -> tuple[bool, int]:
        return (last is not None and last(item), position[item])

    ready = [(*key(i), i) for i in items if pending[i] == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        *_, item = heapq.heappop(ready)
        order.append(item)
        for u in users[item]:
            pending[u] -= 1
            if pending[u] == 0:
                heapq.heappush(ready, (*key(u), u))
    if len(order) != len(items):
        stuck = [getattr(i, "name", i) for i in items if pending[i] > 0][:5]
        raise ValueError(f"graph has a cycle outside a while loop (involving {stuck})")
    return order


def topological_order(nodes: list[Node]) -> list[Node]:
    """Stable in ``nodes`` order; loop back edges (Merge <- NextIteration) are left out."""
    return stable_toposort(nodes, lambda n: (src for src in deps(n) if not is_back_edge(n, src)))
