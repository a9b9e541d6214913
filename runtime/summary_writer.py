"""``fm.summary.FileWriter``: TensorBoard event files, locally or in the job's object store.

The records are framed and checksummed by the ``tensorboard`` package's own
``RecordWriter`` and the events are its protos, so TensorBoard reads the files as it reads
TensorFlow's. A file is named as TensorFlow names one (``events.out.tfevents.<time>.
<host>.<pid>.<n>``), so the tasks of a job (each its own host, or its own pid on one
machine) never share a file, and TensorBoard shows them as one run per directory.

A local directory (a path or ``file://``) is written in place and flushed at every event,
so a running TensorBoard sees each point as it lands. An object store (``s3://``) has no
append: events go to a local file and the whole file is uploaded on ``flush()``, at
``close()``, at exit, and when an event arrives ``flush_secs`` after the last upload (as
TensorFlow's own S3 file system uploads a file on flush and close).

The job's summary directory (``spec.training.summaryUri``, by default ``summaries``
beside its checkpoints; the local launcher's default is ``logs/<job>``) reaches each task
as ``FLOWMILL_SUMMARY_URI``: ``job_logdir()`` reads it.
"""

from __future__ import annotations

import atexit
import itertools
import os
import socket
import tempfile
import threading
import time
import weakref
from typing import Any
from urllib.parse import unquote, urlsplit

import numpy as np

from .cluster import ENV_SUMMARY_URI

_COUNTER = itertools.count()
_LOCAL_SCHEMES = ("", "file")


def job_logdir(default: str | None = None) -> str | None:
    """Where this task of a job writes summaries (``FLOWMILL_SUMMARY_URI``), else
    ``default``: a script passes its own ``--logdir`` (or None: no summaries) alone."""
    return os.environ.get(ENV_SUMMARY_URI) or default


class FileWriter:
    """TensorFlow 1.x's ``tf.summary.FileWriter``: events for TensorBoard in ``logdir``.

    ``add_summary`` takes what a summary op returns (the serialized bytes, as a uint8
    array), bytes, or a ``Summary`` proto; ``add_graph`` shows the graph in TensorBoard's
    Graphs tab. ``max_queue`` is accepted for TensorFlow's signature: every event is
    written to the local file when added.
    """

    def __init__(self, logdir: str | os.PathLike, graph=None, max_queue: int = 10,
                 flush_secs: float = 120, filename_suffix: str = ""):
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._record_writer_cls = RecordWriter
        self.logdir = os.fspath(logdir)
        if not self.logdir:
            raise ValueError("FileWriter needs a logdir (a directory, file:// or s3:// URI)")
        if flush_secs <= 0:
            raise ValueError(f"FileWriter: flush_secs must be > 0, got {flush_secs!r}")
        self.flush_secs = float(flush_secs)
        self.max_queue = max_queue
        self._store: Any = None
        self._key = ""
        self._lock = threading.Lock()
        name = (f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}."
                f"{os.getpid()}.{next(_COUNTER)}{filename_suffix}")
        parts = urlsplit(self.logdir)
        if parts.scheme.lower() in _LOCAL_SCHEMES:
            directory = unquote(parts.path) if parts.scheme else self.logdir
            os.makedirs(directory, exist_ok=True)
            self.path = os.path.join(directory, name)
        else:
            from flowmill.kernels.checkpoint_store import open_store

            self._store, prefix = open_store(self.logdir)
            self._key = f"{prefix}/{name}" if prefix else name
            fd, self.path = tempfile.mkstemp(prefix="flowmill-events-")
            os.close(fd)
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed by close()
        self._writer = RecordWriter(self._file)
        self._uploaded_at = time.monotonic()
        self._dirty = False
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_at_exit, weakref.ref(self))
        atexit.register(self._finalizer)
        self.add_event(_event(file_version="brain.Event:2"))
        if graph is not None:
            self.add_graph(graph)

    # ---- adding
    def add_summary(self, summary, global_step: int | None = None) -> None:
        """One step's summaries (a summary op's value, bytes or a ``Summary`` proto)."""
        from tensorboard.compat.proto import summary_pb2

        if isinstance(summary, summary_pb2.Summary):
            proto = summary
        else:
            proto = summary_pb2.Summary.FromString(_as_bytes(summary))
        self.add_event(_event(summary=proto, step=global_step))

    def add_graph(self, graph, global_step: int | None = None) -> None:
        """The graph, for TensorBoard's Graphs tab (ops, inputs, devices, output shapes)."""
        self.add_event(_event(graph_def=tensorboard_graph_def(graph).SerializeToString(),
                              step=global_step))

    def add_event(self, event) -> None:
        with self._lock:
            if self._closed:
                raise ValueError(f"FileWriter for {self.logdir} is closed (reopen() it)")
            self._writer.write(event.SerializeToString())
            self._file.flush()
            self._dirty = True
            due = time.monotonic() - self._uploaded_at >= self.flush_secs
        if self._store is not None and due:
            self.flush()

    # ---- life cycle
    def get_logdir(self) -> str:
        return self.logdir

    def flush(self) -> None:
        """Everything added so far on disk, and in the object store for a remote logdir."""
        with self._lock:
            if self._closed:
                return
            self._file.flush()
            if self._store is None or not self._dirty:
                return
            with open(self.path, "rb") as f:
                body = f.read()
            self._store.put(self._key, body)
            self._uploaded_at = time.monotonic()
            self._dirty = False

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._file.close()
            if self._store is not None:
                os.unlink(self.path)
        atexit.unregister(self._finalizer)
        self._finalizer.detach()

    def reopen(self) -> None:
        """A closed writer writes again, to a new event file in the same logdir."""
        if self._closed:
            self.__init__(self.logdir, flush_secs=self.flush_secs, max_queue=self.max_queue)

    def __enter__(self) -> FileWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _close_at_exit(ref) -> None:
    writer = ref()
    if writer is not None:
        writer.close()


def _as_bytes(value) -> bytes:
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    array = np.asarray(value)
    if array.dtype != np.uint8 or array.ndim != 1:
        raise TypeError(
            "add_summary takes a summary op's value (a uint8 vector), bytes or a Summary "
            f"proto, got {type(value).__name__} {getattr(array, 'dtype', '')}"
        )
    return array.tobytes()


def _event(step: int | None = None, **fields):
    from tensorboard.compat.proto import event_pb2

    event = event_pb2.Event(wall_time=time.time(), **fields)
    if step is not None:
        event.step = int(step)
    return event


def tensorboard_graph_def(graph):
    """The graph as TensorBoard's ``GraphDef``: each op with its type, inputs (``^name``
    for control inputs), device, plain attrs and output shapes."""
    from tensorboard.compat.proto import attr_value_pb2, graph_pb2, tensor_shape_pb2

    def shape_proto(shape) -> Any:
        if shape is None:
            return tensor_shape_pb2.TensorShapeProto(unknown_rank=True)
        return tensor_shape_pb2.TensorShapeProto(dim=[
            tensor_shape_pb2.TensorShapeProto.Dim(size=-1 if d is None else int(d))
            for d in shape])

    def attr(value) -> Any:
        if isinstance(value, bool):
            return attr_value_pb2.AttrValue(b=value)
        if isinstance(value, int):
            return attr_value_pb2.AttrValue(i=value)
        if isinstance(value, float):
            return attr_value_pb2.AttrValue(f=value)
        if isinstance(value, str):
            return attr_value_pb2.AttrValue(s=value.encode())
        return None

    out = graph_pb2.GraphDef()
    for op in graph.get_operations():
        node = out.node.add(name=op.name, op=op.type, device=op.device or "")
        node.input.extend(t.op.name if t.index == 0 else f"{t.op.name}:{t.index}"
                          for t in op.inputs)
        node.input.extend(f"^{c.name}" for c in op.control_inputs)
        for key, value in op.attrs.items():
            proto = attr(value)
            if proto is not None:
                node.attr[key].CopyFrom(proto)
        shapes = attr_value_pb2.AttrValue.ListValue(
            shape=[shape_proto(t.shape) for t in op.outputs])
        node.attr["_output_shapes"].CopyFrom(attr_value_pb2.AttrValue(list=shapes))
    return out
