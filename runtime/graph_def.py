"""GraphDef: a step (usually one device's partition) as a message for another task.

The task that runs a partition holds none of the Operations it was built from, so all
that compiling it needs travels in the message: op types, attrs, output dtypes and
shapes, devices, and the while-loop frames each node belongs to. Attrs decode to exactly
the Python values they came from, because kernels bind them as they are.

A message arrives from the network, so decoding trusts nothing in it: a malformed one is
a ``GraphDefError`` (a ``ValueError``) naming the node and the field, raised here rather
than from deep inside the compiler or, worse, as a loop that never ends.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from . import ops  # noqa: F401  (registers every op a GraphDef may name)
from .op_def import OPS
from .protos import graph_pb2
from .step_graph import Node, Ref, StepGraph, topological_order

GraphDef = graph_pb2.GraphDef

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# Attrs holding a shape, or a sequence of shapes: their tuples travel as TensorShape.
_SHAPE_DEPTH = {"shape": 0, "shapes": 1}
# A node's part in its loop frame, and the op type each part is played by.
_ROLE_TYPES = {
    "enter": "Enter",
    "enter_const": "Enter",
    "merge": "Merge",
    "switch": "Switch",
    "loop_cond": "LoopCond",
    "next": "NextIteration",
}


class GraphDefError(ValueError):
    """A step that cannot be written as a GraphDef, or a GraphDef that is not a valid step."""


# ---- encoding


def to_graph_def(step: StepGraph) -> graph_pb2.GraphDef:
    """The step as a message; ``from_graph_def`` rebuilds an equivalent one from it."""
    msg = graph_pb2.GraphDef()
    members = set(step.nodes)
    seen: set[str] = set()
    for n in step.nodes:
        if n.name in seen:
            raise GraphDefError(f"two nodes of the step are named {n.name!r}")
        seen.add(n.name)

    def name_of(node: Node, what: str) -> str:
        if node not in members:
            raise GraphDefError(f"{what} refers to {node.name!r}, which is not a node of the step")
        return node.name

    for n in step.nodes:
        _encode_node(n, msg.node.add(), name_of)
    for i, (src, index) in enumerate(step.fetches):
        msg.fetch.add(node=name_of(src, f"fetch {i}"), index=index)
    msg.target.extend(name_of(t, "a target") for t in step.targets)
    for i, arg in enumerate(step.feeds):
        if arg.type != "_Arg" or arg.attrs.get("index") != i:
            raise GraphDefError(f"feed {i} is {arg.name!r} ({arg.type}), not an _Arg of index {i}")
        name_of(arg, f"feed {i}")
    msg.num_feeds = len(step.feeds)
    return msg


def _encode_node(n: Node, out: graph_pb2.NodeDef, name_of) -> None:
    where = f"node {n.name!r} ({n.type})"
    out.name, out.op, out.device = n.name, n.type, n.device
    for k, (src, index) in enumerate(n.inputs):
        out.input.add(node=name_of(src, f"{where} input {k}"), index=index)
    out.control_input.extend(name_of(c, f"{where} control input") for c in n.control)
    for key, value in n.attrs.items():
        if not isinstance(key, str):
            raise GraphDefError(f"{where}: attr name {key!r} is not a string")
        try:
            _encode_attr(value, out.attr[key], _SHAPE_DEPTH.get(key, -1))
        except _Unsupported as e:
            raise GraphDefError(f"{where} attr {key!r}: {e}") from None
    if not len(n.dtypes) == len(n.shapes) == n.num_outputs:
        raise GraphDefError(
            f"{where}: {n.num_outputs} outputs but {len(n.dtypes)} dtypes and "
            f"{len(n.shapes)} shapes"
        )
    for i, (dtype, shape) in enumerate(zip(n.dtypes, n.shapes, strict=True)):
        try:
            out.output_dtype.append(_dtype_name(dtype))
            if shape is not None and not _is_shape(shape):
                raise _Unsupported(f"{shape!r} is not a shape")
            _encode_shape(shape, out.output_shape.add())
        except _Unsupported as e:
            raise GraphDefError(f"{where} output {i}: {e}") from None
    out.frame.extend(n.frames)
    out.loop_role = n.loop_role or ""
    out.in_control_flow = n.in_control_flow


class _Unsupported(Exception):
    pass


def _encode_attr(value: Any, out: graph_pb2.AttrValue, shape_depth: int) -> None:
    """Exact types only: a subclass (a namedtuple, an IntEnum) would come back as its base."""
    kind = type(value)
    if value is None:
        out.none.SetInParent()
    elif kind is bool:
        out.b = value
    elif kind is int:
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise _Unsupported(f"int {value} does not fit in 64 bits")
        out.i = value
    elif kind is float:
        out.f = value
    elif kind is str:
        try:
            out.s = value
        except UnicodeEncodeError as e:
            raise _Unsupported(f"string {value!r} is not valid Unicode ({e.reason})") from None
    elif isinstance(value, np.dtype):
        out.dtype = _dtype_name(value)
    elif kind is np.ndarray:
        _encode_tensor(value, out.tensor)
    elif isinstance(value, np.generic):
        _encode_tensor(np.asarray(value), out.tensor)
        out.tensor.scalar = True
    elif kind is tuple and shape_depth == 0 and _is_shape(value):
        _encode_shape(value, out.shape)
    elif kind is tuple or kind is list:
        out.list.SetInParent()
        out.list.is_list = kind is list
        for v in value:
            _encode_attr(v, out.list.value.add(), shape_depth - 1)
    else:
        raise _Unsupported(f"cannot serialize a value of type {kind.__module__}.{kind.__name__}")


def _is_shape(value) -> bool:
    return type(value) is tuple and all(
        d is None or (type(d) is int and 0 <= d <= _INT64_MAX) for d in value
    )


def _encode_shape(shape, out: graph_pb2.TensorShape) -> None:
    if shape is None:
        out.unknown_rank = True
    else:
        out.dim.extend(-1 if d is None else d for d in shape)


def _encode_tensor(a: np.ndarray, out: graph_pb2.TensorProto) -> None:
    if a.dtype.hasobject:
        raise _Unsupported(f"cannot serialize an array of dtype {a.dtype} (Python objects)")
    out.dtype = _dtype_name(a.dtype)
    out.shape.dim.extend(a.shape)
    out.content = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()


def _dtype_name(dtype) -> str:
    """The dtype's name where that names it exactly (readable), else its full string."""
    if not isinstance(dtype, np.dtype):
        raise _Unsupported(f"{dtype!r} is not a NumPy dtype")
    if dtype.names is None and dtype.subdtype is None:
        for s in (dtype.name, dtype.str):
            try:
                if np.dtype(s) == dtype:
                    return s
            except TypeError:
                continue
    raise _Unsupported(f"cannot serialize dtype {dtype!r}")


# ---- decoding


def from_graph_def(msg: graph_pb2.GraphDef | bytes) -> StepGraph:
    """Rebuild the step of a GraphDef (or its serialized bytes), checking it on the way."""
    if isinstance(msg, (bytes, bytearray, memoryview)):
        try:
            msg = graph_pb2.GraphDef.FromString(bytes(msg))
        except DecodeError as e:
            raise GraphDefError(f"not a serialized GraphDef: {e}") from None
    elif not isinstance(msg, graph_pb2.GraphDef):
        raise GraphDefError(f"expected a GraphDef or its bytes, got {type(msg).__name__}")
    nodes: list[Node] = []
    by_name: dict[str, Node] = {}
    for nd in msg.node:
        if nd.name in by_name:
            raise GraphDefError(f"two nodes are named {nd.name!r}")
        node = _decode_node(nd)
        by_name[nd.name] = node
        nodes.append(node)

    def ref(r: graph_pb2.TensorRef, what: str) -> Ref:
        src = by_name.get(r.node)
        if src is None:
            raise GraphDefError(f"{what} {r.node}:{r.index} names no node of the graph")
        if not 0 <= r.index < src.num_outputs:
            raise GraphDefError(
                f"{what} {r.node}:{r.index}: node {r.node!r} ({src.type}) has "
                f"{src.num_outputs} outputs"
            )
        return (src, r.index)

    for nd, node in zip(msg.node, nodes, strict=True):
        where = f"node {nd.name!r} ({nd.op})"
        node.inputs = [ref(r, f"{where} input {k}") for k, r in enumerate(nd.input)]
        for c in nd.control_input:
            if c not in by_name:
                raise GraphDefError(f"{where} control input {c!r} names no node of the graph")
            node.control.append(by_name[c])
    fetches = [ref(r, f"fetch {i}") for i, r in enumerate(msg.fetch)]
    targets = []
    for t in msg.target:
        if t not in by_name:
            raise GraphDefError(f"target {t!r} names no node of the graph")
        targets.append(by_name[t])
    feeds = _feeds(nodes, msg.num_feeds)
    _check_loops(nodes)
    _check_acyclic(nodes)
    return StepGraph(nodes=nodes, fetches=fetches, targets=targets, feeds=feeds)


def _check_acyclic(nodes: list[Node]) -> None:
    """A cycle outside a while loop's back edge (a node taking its own output included)
    would never run; refused here, not found by the compiler."""
    for n in nodes:
        if any(src is n for src, _ in n.inputs) or n in n.control:
            raise GraphDefError(f"node {n.name!r} ({n.type}) takes its own output: a cycle")
    try:
        topological_order(nodes)
    except ValueError as e:
        raise GraphDefError(str(e)) from None


def _decode_node(nd: graph_pb2.NodeDef) -> Node:
    where = f"node {nd.name!r} ({nd.op})"
    if not nd.name:
        raise GraphDefError(f"a node of op {nd.op!r} has no name")
    if nd.op == "_Arg":
        defaults: dict[str, Any] = {"index": None}
        num_inputs: int | None = 0
    elif nd.op in OPS:
        defaults, num_inputs = OPS[nd.op].attrs, OPS[nd.op].num_inputs
    else:
        raise GraphDefError(f"{where}: unknown op type {nd.op!r}")
    if num_inputs is not None and len(nd.input) != num_inputs:
        raise GraphDefError(
            f"{where}: takes {num_inputs} inputs, the message gives {len(nd.input)}"
        )
    attrs = dict(defaults)
    for key in sorted(nd.attr):  # proto maps have no order; make decoding deterministic
        if key not in defaults:
            raise GraphDefError(
                f"{where}: unknown attr {key!r} (accepted: {', '.join(sorted(defaults)) or 'none'})"
            )
        attrs[key] = _decode_attr(nd.attr[key], f"{where} attr {key!r}")
    if len(nd.output_shape) != len(nd.output_dtype):
        raise GraphDefError(
            f"{where}: {len(nd.output_dtype)} output dtypes but {len(nd.output_shape)} shapes"
        )
    dtypes = [_parse_dtype(d, f"{where} output {i}") for i, d in enumerate(nd.output_dtype)]
    shapes = [_decode_shape(s, f"{where} output {i}") for i, s in enumerate(nd.output_shape)]
    role = nd.loop_role or None
    if role is not None:
        if role not in _ROLE_TYPES:
            raise GraphDefError(f"{where}: unknown loop role {role!r}")
        if _ROLE_TYPES[role] != nd.op:
            raise GraphDefError(f"{where}: loop role {role!r} belongs to {_ROLE_TYPES[role]} ops")
        if not nd.frame:
            raise GraphDefError(f"{where}: loop role {role!r} outside any loop frame")
    if any(not f for f in nd.frame):
        raise GraphDefError(f"{where}: an empty loop frame name")
    return Node(
        nd.op,
        nd.name,
        attrs,
        [],
        [],
        len(dtypes),
        dtypes,
        shapes,
        device=nd.device,
        frames=tuple(nd.frame),
        loop_role=role,
        in_control_flow=nd.in_control_flow,
    )


def _decode_attr(v: graph_pb2.AttrValue, where: str) -> Any:
    kind = v.WhichOneof("value")
    if kind == "i":
        return v.i
    if kind == "f":
        return v.f
    if kind == "b":
        return v.b
    if kind == "s":
        return v.s
    if kind == "none":
        return None
    if kind == "dtype":
        return _parse_dtype(v.dtype, where)
    if kind == "shape":
        return _decode_shape(v.shape, where)
    if kind == "tensor":
        return _decode_tensor(v.tensor, where)
    if kind == "list":
        items = [_decode_attr(x, where) for x in v.list.value]
        return items if v.list.is_list else tuple(items)
    raise GraphDefError(f"{where}: no value set")


def _parse_dtype(s: str, where: str) -> np.dtype:
    try:
        dtype = np.dtype(s)
    except Exception as e:  # NumPy's parser raises several kinds for text it rejects
        raise GraphDefError(f"{where}: {s!r} is not a dtype ({e})") from None
    if dtype.names is not None or dtype.subdtype is not None:
        raise GraphDefError(f"{where}: {s!r} is a structured dtype; only plain ones travel")
    return dtype


def _decode_shape(s: graph_pb2.TensorShape, where: str):
    if s.unknown_rank:
        if s.dim:
            raise GraphDefError(f"{where}: a shape of unknown rank lists dims {list(s.dim)}")
        return None
    if any(d < -1 for d in s.dim):
        raise GraphDefError(f"{where}: shape dims must be -1 (unknown) or >= 0: {list(s.dim)}")
    return tuple(None if d == -1 else d for d in s.dim)


def _decode_tensor(t: graph_pb2.TensorProto, where: str) -> np.ndarray | np.generic:
    dtype = _parse_dtype(t.dtype, where)
    if dtype.hasobject:
        raise GraphDefError(f"{where}: a tensor of dtype {dtype} cannot travel")
    if t.shape.unknown_rank or any(d < 0 for d in t.shape.dim):
        raise GraphDefError(f"{where}: a tensor's shape must be fully known")
    shape = tuple(t.shape.dim)
    count = math.prod(shape)
    if len(t.content) != count * dtype.itemsize:
        raise GraphDefError(
            f"{where}: {len(t.content)} bytes of content for a {dtype} tensor of shape {shape}"
        )
    try:
        if count == 0 or dtype.itemsize == 0:
            array = np.zeros(shape, dtype)
        else:
            raw = np.frombuffer(t.content, dtype=dtype.newbyteorder("<"), count=count)
            array = raw.reshape(shape).astype(dtype)  # writable, in the recorded byte order
    except (ValueError, TypeError, OverflowError, MemoryError) as e:
        raise GraphDefError(
            f"{where}: cannot build a {dtype} tensor of shape {shape}: {e}"
        ) from None
    if t.scalar:
        if shape != ():
            raise GraphDefError(f"{where}: a scalar with shape {shape}")
        return array[()]
    return array


def _feeds(nodes: list[Node], num_feeds: int) -> list[Node]:
    args = sum(n.type == "_Arg" for n in nodes)
    if num_feeds != args:  # checked first: a message may claim any count in a few bytes
        raise GraphDefError(f"num_feeds is {num_feeds}, the graph has {args} _Arg node(s)")
    feeds: dict[int, Node] = {}
    for n in nodes:
        if n.type != "_Arg":
            continue
        index = n.attrs["index"]
        if type(index) is not int or not 0 <= index < num_feeds:
            raise GraphDefError(
                f"node {n.name!r} (_Arg): index {index!r} is not one of the {num_feeds} feeds"
            )
        if index in feeds:
            raise GraphDefError(
                f"nodes {feeds[index].name!r} and {n.name!r} both take feed {index}"
            )
        feeds[index] = n
    return [feeds[i] for i in range(num_feeds)]  # as many _Arg nodes, distinct indexes


def _check_loops(nodes: list[Node]) -> None:
    """Check the frame structure the compiler builds ``while`` loops from.

    Without these a bad message would fail deep inside the compiler or, lacking a
    LoopCond, compile into a loop that never exits.
    """
    parents: dict[str, tuple[str, ...]] = {}
    conds: dict[str, int] = {}
    merges: dict[str, int] = {}
    next_used: set[Node] = set()
    for n in nodes:
        where = f"node {n.name!r} ({n.type})"
        for k, frame in enumerate(n.frames):
            parent = parents.setdefault(frame, n.frames[:k])
            if parent != n.frames[:k]:
                raise GraphDefError(
                    f"{where}: frame {frame!r} is nested in {list(n.frames[:k])} here, "
                    f"in {list(parent)} elsewhere"
                )
        role = n.loop_role
        same_frame = [src.frames == n.frames for src, _ in n.inputs]
        if role == "loop_cond":
            conds[n.frames[-1]] = conds.get(n.frames[-1], 0) + 1
        elif role == "merge":
            merges[n.frames[-1]] = merges.get(n.frames[-1], 0) + 1
            kinds = [src.loop_role for src, _ in n.inputs]
            if len(kinds) != 2 or kinds[0] != "enter" or kinds[1] != "next" or not all(same_frame):
                raise GraphDefError(
                    f"{where}: a loop merge takes its frame's Enter, then its NextIteration"
                )
            next_used.add(n.inputs[1][0])
        elif role == "switch":
            if n.inputs[0][0].loop_role != "merge" or not all(same_frame):
                raise GraphDefError(f"{where}: a loop switch takes its frame's merge and LoopCond")
    for n in nodes:
        if n.loop_role == "next" and n not in next_used:
            raise GraphDefError(f"node {n.name!r} (NextIteration): no loop merge takes it")
    for frame in parents:
        if conds.get(frame, 0) != 1 or not merges.get(frame):
            raise GraphDefError(
                f"loop frame {frame!r} has {conds.get(frame, 0)} LoopCond nodes and "
                f"{merges.get(frame, 0)} merges; a loop needs one LoopCond and at least one merge"
            )
