"""Export a trained model for inference and load it where no training code runs.

TensorFlow 1.x's ``tf.saved_model`` in Flowmill's terms. ``save`` writes a directory (a
local path, ``file://`` or ``s3://``) of three files:

- ``graph.pb``: the step that computes the outputs from the inputs, pruned as a session
  prunes one (``prune``): each input is an ``_Arg`` feed and each output a fetch, so
  nothing the outputs do not need (optimizer, global step, savers, input queues) is in
  it. It is the ``GraphDef`` a task server compiles, with every device cleared: a model
  trained across parameter servers runs in one process.
- ``variables.safetensors``: the value of every variable the graph reads, by its shared
  name, read with ``sess.run``, so a distributed session's come from its PS tasks.
- ``signature.json``: the format and version, and each input's and output's tensor name,
  dtype and shape (``null`` for an unknown dim).

``load`` does what a task server does with a registered graph (decode it, checking every
field; optimize; compile against state of its own) after checking each file against the
others, naming the file and the variable or field that is wrong. The variables get their
values from a restore step of ``AssignVariableOp`` nodes fed the file's arrays, the kernels
a checkpoint restore runs: not frozen into constants, they stay the trained graph's own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import unquote, urlsplit

import numpy as np
import safetensors.numpy
from obstore.exceptions import NotFoundError

from flowmill.kernels import DEAD, shapes
from flowmill.kernels.checkpoint_store import open_store
from flowmill.kernels.resources import Resources

from . import passes
from .executor import compile_step
from .graph import Tensor
from .graph_def import GraphDefError, from_graph_def, to_graph_def
from .prune import prune
from .session import FeedError, convert_feed
from .step_graph import Node, StepGraph

FORMAT = "flowmill-saved-model"
VERSION = 1
GRAPH_FILE = "graph.pb"
VARIABLES_FILE = "variables.safetensors"
SIGNATURE_FILE = "signature.json"

# Stateful ops an inference step may hold: reading variables, drawing random numbers,
# checks and prints, and the state of control flow inside one step. Any other (a variable
# update, a queue or iterator, a checkpoint or coordination op) belongs to training.
_INFERENCE_STATEFUL = frozenset(
    "VarHandleOp ReadVariableOp VarIsInitializedOp RandomStandardNormal RandomUniform "
    "TruncatedNormal LogUniformCandidateSampler Assert Print StackV2 StackPushV2 StackPopV2 "
    "TensorArrayV3 TensorArrayReadV3 TensorArrayWriteV3 TensorArraySizeV3 TensorArrayStackV3 "
    "TensorArrayUnstackV3 TensorArrayGradV3".split()
)


class SavedModelError(ValueError):
    """An export that cannot be written as asked, or files that are not a valid export."""


class PredictionError(RuntimeError):
    """A prediction the model could not compute; the message names the node that failed.
    ``bad_input`` is True when a kernel refused the values (a ``ValueError``: shapes that do
    not fit together, a failed ``Assert``), so the caller's input is what is wrong."""

    def __init__(self, message: str, bad_input: bool):
        super().__init__(message)
        self.bad_input = bad_input


# ---- where an export lives


class _Location:
    """A local directory, or a prefix in an object store (``s3://``, through the stores
    checkpoints use). A ``memory://`` store lasts one call, so it cannot hold an export."""

    def __init__(self, path: str | os.PathLike):
        self.where = os.fspath(path)
        parts = urlsplit(self.where)
        scheme, self.local, self.store, self.prefix = parts.scheme.lower(), None, None, ""
        if scheme in ("s3", "s3a"):
            self.store, self.prefix = open_store(self.where)
        elif scheme == "" or (scheme == "file" and parts.netloc in ("", "localhost")
                              and os.path.isabs(unquote(parts.path))):
            self.local = Path(unquote(parts.path) if scheme else self.where).absolute()
        else:
            raise SavedModelError(f"{self.where!r} is not a directory, an absolute file:// "
                                  "URI (file:///dir) or an s3:// URI")

    def name(self, file: str) -> str:
        return f"{self.where.rstrip('/')}/{file}"

    def is_empty(self) -> bool:
        if self.local is None:
            return not any(self.store.list(self.prefix or None, chunk_size=1))
        if self.local.exists() and not self.local.is_dir():
            raise SavedModelError(f"{self.where} is a file; an export is a directory")
        return not self.local.exists() or not any(self.local.iterdir())

    def write(self, file: str, data: bytes) -> None:
        if self.local is None:
            self.store.put(f"{self.prefix}/{file}".lstrip("/"), data)
            return
        self.local.mkdir(parents=True, exist_ok=True)
        partial = self.local / f".{file}.partial"
        partial.write_bytes(data)
        partial.replace(self.local / file)  # whole or absent, never half written

    def read(self, file: str) -> bytes:
        try:
            if self.local is not None:
                return (self.local / file).read_bytes()
            return bytes(self.store.get(f"{self.prefix}/{file}".lstrip("/")).bytes())
        except (FileNotFoundError, NotFoundError):
            raise SavedModelError(f"{self.name(file)} is missing: {self.where} is not a "
                                  "complete export") from None
        except OSError as e:
            raise SavedModelError(f"cannot read {self.name(file)}: {e}") from None


# ---- saving


def save(sess, path: str | os.PathLike, inputs: Mapping[str, Any],
         outputs: Mapping[str, Any]) -> dict:
    """Export what ``outputs`` need given ``inputs`` (names -> tensors of ``sess.graph``)
    with the variables' current values in ``sess``; returns the signature written. The
    directory must be new or empty: an export is never overwritten in part."""
    where = _Location(path)
    if not where.is_empty():
        raise SavedModelError(f"{where.where} is not empty: an export needs a new directory")
    feeds = _tensors(sess.graph, inputs, "input")
    fetches = _tensors(sess.graph, outputs, "output")
    if not fetches:
        raise SavedModelError("an export needs at least one output")
    if len(set(feeds.values())) < len(feeds):
        raise SavedModelError(f"two inputs are one tensor: {[t.name for t in feeds.values()]}")
    step = prune(list(fetches.values()), [], list(feeds.values()))
    _check_inference(step, list(feeds))
    handles = _variables(step)
    values = sess.run([_read_of(node) for node in handles.values()]) if handles else []
    # np.asarray, not ascontiguousarray: that makes a scalar variable 1-d
    arrays = {name: np.asarray(v, order="C") for name, v in zip(handles, values, strict=True)}
    for name, node in handles.items():
        _check_value(node, arrays[name], "the session holds")
    try:
        msg = to_graph_def(step)
    except GraphDefError as e:
        raise SavedModelError(f"cannot export the graph: {e}") from None
    for node in msg.node:
        node.device = ""  # one process runs it all
    signature = {"format": FORMAT, "version": VERSION,
                 "inputs": {name: _spec(t) for name, t in feeds.items()},
                 "outputs": {name: _spec(t) for name, t in fetches.items()}}
    try:
        blob = safetensors.numpy.save(arrays, metadata={"format": FORMAT})
    except Exception as e:  # the library's own error types name the unsupported dtype
        raise SavedModelError(f"cannot write the variables {sorted(arrays)}: {e}") from None
    where.write(VARIABLES_FILE, blob)
    where.write(GRAPH_FILE, msg.SerializeToString(deterministic=True))
    where.write(SIGNATURE_FILE, json.dumps(signature, indent=1).encode())  # last: complete
    return signature


def _tensors(graph, named: Mapping[str, Any], kind: str) -> dict[str, Tensor]:
    if not isinstance(named, Mapping):
        raise SavedModelError(f"{kind}s must map names to tensors, got {type(named).__name__}")
    out = {}
    for name, value in named.items():
        if not isinstance(name, str) or not name:
            raise SavedModelError(f"{kind} name {name!r} is not a non-empty string")
        try:
            t = graph.as_graph_element(value)
        except (TypeError, ValueError, KeyError) as e:
            raise SavedModelError(f"{kind} {name!r}: {e}") from None
        if not isinstance(t, Tensor):
            raise SavedModelError(f"{kind} {name!r} is operation {t.name!r}, not a tensor")
        out[name] = t
    return out


def _check_inference(step: StepGraph, inputs: list[str]) -> None:
    """Refuse a step that would need a feed it will not get, or would train."""
    for n in step.nodes:
        if n.type == "Placeholder":
            t, listed = n.op.outputs[0], ", ".join(map(repr, inputs)) or "none"
            raise SavedModelError(
                f"the outputs need placeholder {n.name!r} (shape {shapes.fmt(t.shape)}, "
                f"{t.dtype}), which is not an input (inputs: {listed})")
        if n.stateful and n.type not in _INFERENCE_STATEFUL:
            why = ("reads input from a queue or iterator: make the tensor it yields an input"
                   if n.type.startswith(("Queue", "FIFOQueue", "Iterator")) else
                   "changes state: training does that, an export only reads its variables")
            raise SavedModelError(f"the outputs need node {n.name!r} ({n.type}), which {why}")


def _variables(step: StepGraph) -> dict[str, Node]:
    """The variables the step reads, by the name their state is kept under."""
    found: dict[str, Node] = {}
    for n in step.nodes:
        if n.type == "VarHandleOp":
            found.setdefault(n.attrs["shared_name"] or n.name, n)
    return found


def _read_of(handle: Node) -> Tensor:
    """A read of the variable that a session can fetch: one outside any cond or loop."""
    for op in handle.op.outputs[0].consumers():
        if op.type == "ReadVariableOp" and op.cf_context is None:
            return op.outputs[0]
    raise SavedModelError(f"variable {handle.name!r} has no read outside control flow to "
                          "fetch its value with")


def _check_value(handle: Node, array: np.ndarray, where: str) -> None:
    name = handle.attrs["shared_name"] or handle.name
    dtype, shape = handle.attrs["dtype"], handle.attrs["shape"]
    if array.dtype != dtype or not shapes.compatible(shape, array.shape):
        raise SavedModelError(
            f"variable {name!r}: {where} a {array.dtype} value of shape {array.shape}, the "
            f"graph's variable is {dtype} of shape {shapes.fmt(shape)}")


def _spec(t: Tensor) -> dict:
    return {"name": t.name, "dtype": np.dtype(t.dtype).name,
            "shape": None if t.shape is None else list(t.shape)}


# ---- loading


class _Input(NamedTuple):
    """An input as the session's feed checks read a placeholder, so a bad value is refused
    with the runtime's own messages, naming the input."""

    name: str
    dtype: np.dtype
    shape: tuple | None
    type: str = "input"

    @property
    def op(self) -> _Input:
        return self


class SavedModel:
    """A loaded export: call it with the inputs (keyword arguments or one mapping of names
    to arrays or nested lists) for a dict of NumPy outputs. Safe to call from several
    threads at once, as a session's steps are."""

    def __init__(self, path: str, signature: dict, plan, inputs: list[_Input]):
        self.path, self.signature, self._plan, self._inputs = path, signature, plan, inputs
        self.input_names: list[str] = [spec.name for spec in inputs]
        self.output_names: list[str] = list(signature["outputs"])

    def __call__(self, feeds: Mapping[str, Any] | None = None, /, **kwargs) -> dict:
        given = dict(feeds or {})
        if set(given) & set(kwargs):
            raise FeedError(f"input(s) {sorted(set(given) & set(kwargs))} given twice")
        given.update(kwargs)
        names = self.input_names
        wrong = [f"unknown input {n!r}" for n in given if n not in names]
        wrong += [f"missing input {n!r}" for n in names if n not in given]
        if wrong:
            listed = ", ".join(map(repr, names)) or "none"
            raise FeedError(f"{'; '.join(wrong)} (the model takes {listed})")
        args = tuple(_feed(spec, given[spec.name]) for spec in self._inputs)
        try:
            values = self._plan.run(args)
        except Exception as e:  # noqa: BLE001 - re-raised naming the node that failed
            node = self._plan.failing_node(e)
            at = f"node {node.name!r} ({node.type})" if node is not None else "the model"
            raise PredictionError(f"{at} failed: {e}", isinstance(e, ValueError)) from e
        out = {}
        for name, value in zip(self.output_names, values, strict=True):
            if value is DEAD:
                raise PredictionError(f"output {name!r} is on a branch not taken", True)
            # A copy: an output may be a variable's own buffer, or an input passed through.
            out[name] = np.array(value, copy=True)
        return out

    def __repr__(self) -> str:
        return f"<SavedModel {self.path} inputs={self.input_names} outputs={self.output_names}>"


def _feed(spec: _Input, value) -> Any:
    """The session's feed conversion, after refusing strings for a numeric input (NumPy
    would parse "1.5" into a float) and naming the input where a value is no array."""
    if spec.dtype.kind != "O":
        try:
            value = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise FeedError(f"cannot feed {type(value).__name__} to input {spec.name!r}: "
                            f"{e}") from None
        if value.dtype.kind in "US" and spec.dtype.kind not in "US":
            raise FeedError(f"input {spec.name!r} is {spec.dtype}; it was given strings")
    return convert_feed(spec, value)


def load(path: str | os.PathLike) -> SavedModel:
    """The export at ``path``, checked, compiled and holding its variables' values."""
    where = _Location(path)
    signature = _signature(where)
    step = _graph(where, signature)
    handles = _variables(step)
    values = _values(where, handles)
    resources = Resources()
    if handles:
        restore = _restore_step(list(handles.values()))
        compile_step(restore, resources).run(tuple(values[name] for name in handles))
    inputs = [_Input(name, arg.dtypes[0], arg.shapes[0])
              for name, arg in zip(signature["inputs"], step.feeds, strict=True)]
    plan = compile_step(passes.optimize(step, resources), resources)
    return SavedModel(where.where, signature, plan, inputs)


def _signature(where: _Location) -> dict:
    file = where.name(SIGNATURE_FILE)
    try:
        sig = json.loads(where.read(SIGNATURE_FILE))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SavedModelError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(sig, dict) or sig.get("format") != FORMAT:
        got = sig.get("format") if isinstance(sig, dict) else type(sig).__name__
        raise SavedModelError(f"{file}: not a {FORMAT} signature (format {got!r})")
    if sig.get("version") != VERSION:
        raise SavedModelError(f"{file}: version {sig.get('version')!r}; this reader knows "
                              f"{VERSION}")
    for kind in ("inputs", "outputs"):
        if not isinstance(sig.get(kind), dict) or (kind == "outputs" and not sig[kind]):
            raise SavedModelError(f"{file}: {kind!r} must be an object of names and specs"
                                  + (" (at least one)" if kind == "outputs" else ""))
        for name, spec in sig[kind].items():
            if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or \
                    not isinstance(spec.get("dtype"), str) or _shape(spec.get("shape")) is False:
                raise SavedModelError(f"{file}: {kind[:-1]} {name!r} needs a tensor name, a "
                                      f"dtype and a shape (a list of sizes or nulls): {spec!r}")
    return sig


def _shape(dims: Any) -> tuple | None | bool:
    """A signature's shape as the runtime writes one; False when it is not a shape."""
    if dims is None:
        return None
    ok = isinstance(dims, list) and all(d is None or (type(d) is int and d >= 0) for d in dims)
    return tuple(dims) if ok else False


def _graph(where: _Location, sig: dict) -> StepGraph:
    """The step of graph.pb, checked against the signature's inputs and outputs."""
    file = where.name(GRAPH_FILE)
    try:
        step = from_graph_def(where.read(GRAPH_FILE))
    except GraphDefError as e:
        raise SavedModelError(f"{file}: {e}") from None
    inputs, outputs = list(sig["inputs"].items()), list(sig["outputs"].items())
    if len(step.feeds) != len(inputs) or len(step.fetches) != len(outputs) or step.targets:
        raise SavedModelError(
            f"{file} takes {len(step.feeds)} feeds and gives {len(step.fetches)} fetches; the "
            f"signature lists {len(inputs)} inputs and {len(outputs)} outputs")
    refs = [(arg, 0) for arg in step.feeds] + step.fetches
    for k, ((name, spec), (node, i)) in enumerate(zip(inputs + outputs, refs, strict=True)):
        kind = "input" if k < len(inputs) else "output"
        ours = (np.dtype(node.dtypes[i]).name, node.shapes[i])
        if ours != (spec["dtype"], _shape(spec["shape"])) or (
                kind == "input" and node.name != f"_arg_{spec['name']}"):
            raise SavedModelError(
                f"{file} does not match the signature's {kind} {name!r} ({spec['name']}, "
                f"{spec['dtype']} of shape {spec['shape']}): the graph's is {node.name}, "
                f"{ours[0]} of shape {shapes.fmt(ours[1])}")
    for node in step.nodes:
        node.device = ""
    return step


def _values(where: _Location, handles: dict[str, Node]) -> dict[str, np.ndarray]:
    file, data = where.name(VARIABLES_FILE), where.read(VARIABLES_FILE)
    try:
        values = safetensors.numpy.load(data)
    except Exception as e:  # the library raises its own error type for a damaged file
        raise SavedModelError(f"{file} is not a valid safetensors file: {e}") from None
    for name, node in handles.items():
        if name not in values:
            raise SavedModelError(f"{file} holds no variable {name!r}, which the graph reads")
        _check_value(node, values[name], f"{file} holds")
    extra = sorted(set(values) - set(handles))
    if extra:
        raise SavedModelError(f"{file} holds {', '.join(map(repr, extra))}, which the graph "
                              "does not read: the files are from different exports")
    return values


def _restore_step(handles: list[Node]) -> StepGraph:
    """Assign each variable the value fed at its index, as a checkpoint restore does."""
    step = StepGraph(nodes=[], fetches=[], targets=[], feeds=[])
    for i, h in enumerate(handles):
        dtype, shape = h.attrs["dtype"], h.attrs["shape"]
        arg = Node("_Arg", f"_arg_{i}", {"index": i}, [], [], 1, [dtype], [shape])
        handle = Node(h.type, h.name, dict(h.attrs), [], [], 1, h.dtypes, h.shapes)
        assign = Node("AssignVariableOp", f"{h.name}/restore", {"dtype": dtype, "shape": shape},
                      [(handle, 0), (arg, 0)], [], 1, [dtype], [shape])
        step.nodes += [arg, handle, assign]
        step.feeds.append(arg)
        step.targets.append(assign)
    return step
