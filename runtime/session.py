"""Sessions: run steps of a graph. Each distinct (fetches, feeds, targets) is pruned,
optimized and compiled once; later runs of it only execute the cached plan."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from flowmill.kernels import DEAD

from . import passes, shapes
from .cluster import ENV_VAR as CLUSTER_ENV
from .executor import Plan, compile_step
from .graph import Graph, Operation, Tensor, get_default_graph
from .prune import prune
from .resources import Resources


class SessionClosedError(RuntimeError):
    pass


class FeedError(ValueError):
    pass


class _Fetches:
    """Flattens a nest of fetches (tensor, op, name, list, tuple, dict) and rebuilds it."""

    def __init__(self, graph: Graph, fetches: Any):
        self.tensors: list[Tensor] = []
        self.targets: list[Operation] = []
        self.structure = self._flatten(graph, fetches)

    def _flatten(self, graph, f):
        if f is None:
            return None
        if isinstance(f, (list, tuple)):
            return type(f)(self._flatten(graph, x) for x in f)
        if isinstance(f, Mapping):
            return {k: self._flatten(graph, v) for k, v in f.items()}
        element = graph.as_graph_element(f)
        if isinstance(element, Operation):
            self.targets.append(element)
            return None
        self.tensors.append(element)
        return len(self.tensors) - 1

    def rebuild(self, values, s=None, top=True):
        s = self.structure if top else s
        if s is None:
            return None
        if isinstance(s, int):
            return values[s]
        if isinstance(s, Mapping):
            return {k: self.rebuild(values, v, False) for k, v in s.items()}
        return type(s)(self.rebuild(values, x, False) for x in s)


class DefaultSessionScope:
    """``with session:`` makes a session (and its graph) the default, and closes it after."""

    def __enter__(self):
        _default_sessions().append(self)
        self._graph_ctx = self.graph.as_default()
        self._graph_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._graph_ctx.__exit__(*exc)
        _default_sessions().pop()
        self.close()

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the session closes, while it can still run steps (the final
        checkpoint of a job is taken this way)."""
        self.__dict__.setdefault("_close_hooks", []).append(hook)

    def _run_close_hooks(self) -> None:
        """Newest first; the session closes even if one fails (its error propagates)."""
        hooks = self.__dict__.pop("_close_hooks", [])
        errors = []
        for hook in reversed(hooks):
            try:
                hook()
            except Exception as e:  # noqa: BLE001 - re-raised below, after the others ran
                errors.append(e)
        if errors:
            raise errors[0]


class Session(DefaultSessionScope):
    """Runs steps against one graph, holding its variables and queues.

    In a process started as a training task of a cluster (``FLOWMILL_CONFIG`` names a
    worker or the chief), ``Session(...)`` returns a ``DistributedSession`` for that task
    instead, so a model script runs unchanged alone or in a job (see ``transparent``).
    Subclasses are never redirected.
    """

    def __new__(cls, *args, **kwargs):
        if cls is Session and os.environ.get(CLUSTER_ENV):
            from .transparent import cluster_session

            session = cluster_session(*args, **kwargs)
            if session is not None:
                return session
        return super().__new__(cls)

    def __init__(self, graph: Graph | None = None, optimize: bool = True):
        self.graph = graph or get_default_graph()
        self.resources = Resources()
        self.optimize = optimize
        self._plans: dict[tuple, tuple[Plan, _Fetches | None]] = {}
        self._compile_lock = threading.Lock()
        self._closed = False

    def as_default(self):
        return _SessionDefault(self)

    def close(self) -> None:
        if not self._closed:
            try:
                self._run_close_hooks()
            finally:
                self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self.resources.close()
            self._plans.clear()

    # ---- running
    def run(self, fetches, feed_dict: Mapping | None = None, targets=None):
        if self._closed:
            raise SessionClosedError("attempted to use a closed Session")
        feed_dict = feed_dict or {}
        feed_keys = tuple(self._feed_tensor(k) for k in feed_dict)
        plan_key = (_key(fetches), feed_keys, _key(targets))
        cached = self._plans.get(plan_key)
        if cached is None:
            cached = self._compile(fetches, feed_keys, targets, plan_key)
        plan, mapper = cached
        args = tuple(
            _convert_feed(t, v) for t, v in zip(feed_keys, feed_dict.values(), strict=True)
        )
        values = plan.run(args)
        for i, v in enumerate(values):
            if v is DEAD:
                raise ValueError(
                    f"fetched tensor {mapper.tensors[i].name} is dead: it is on a branch "
                    "that this step did not take"
                )
        return mapper.rebuild(values)

    def make_callable(self, fetches, feed_list=(), targets=None):
        """A function taking the feeds positionally; it skips the plan lookup of ``run``."""
        if self._closed:
            raise SessionClosedError("attempted to use a closed Session")
        feed_keys = tuple(self._feed_tensor(k) for k in feed_list)
        plan, mapper = self._compile(fetches, feed_keys, targets, None)

        def call(*feed_values):
            if self._closed:
                raise SessionClosedError("attempted to use a closed Session")
            values = plan.run(
                tuple(_convert_feed(t, v) for t, v in zip(feed_keys, feed_values, strict=True))
            )
            return mapper.rebuild(values)

        call.plan = plan
        return call

    def plan_for(self, fetches, feed_list=(), targets=None) -> Plan:
        feed_keys = tuple(self._feed_tensor(k) for k in feed_list)
        return self._compile(fetches, feed_keys, targets, None)[0]

    def _feed_tensor(self, key) -> Tensor:
        t = self.graph.as_graph_element(key)
        if not isinstance(t, Tensor):
            raise FeedError(f"cannot feed operation {t.name!r}; feed one of its output tensors")
        return t

    def _compile(self, fetches, feed_keys, targets, plan_key):
        with self._compile_lock:
            if plan_key is not None and plan_key in self._plans:
                return self._plans[plan_key]
            mapper, step = prepare_step(
                self.graph, fetches, feed_keys, targets, self.resources, self.optimize
            )
            plan = compile_step(step, self.resources)
            if plan_key is not None:
                self._plans[plan_key] = (plan, mapper)
            return plan, mapper


def prepare_step(graph: Graph, fetches, feed_keys, targets, resources, optimize: bool):
    """The front of every session's compile: the fetch nest flattened, the graph pruned to
    what it needs (every placeholder left in it must be fed), then optimized."""
    mapper = _Fetches(graph, fetches)
    target_ops = list(mapper.targets)
    for t in _as_list(targets):
        element = graph.as_graph_element(t)
        target_ops.append(element.op if isinstance(element, Tensor) else element)
    step = prune(mapper.tensors, target_ops, list(feed_keys))
    for node in step.nodes:
        if node.type == "Placeholder":
            t = node.op.outputs[0]
            raise FeedError(
                f"placeholder {node.name!r} (shape {shapes.fmt(t.shape)}, {t.dtype}) "
                "must be fed: it is needed by this step"
            )
    if optimize:
        step = passes.optimize(step, resources)
    return mapper, step


def _convert_feed(t: Tensor, value) -> np.ndarray:
    if t.dtype.kind == "O":
        return value
    array = value if type(value) is np.ndarray and value.dtype == t.dtype else None
    if array is None:
        try:
            array = np.asarray(value, dtype=t.dtype)
        except (TypeError, ValueError) as e:
            raise FeedError(
                f"cannot feed {type(value).__name__} to {t.name} ({t.dtype}): {e}"
            ) from None
    if t.shape is not None:
        if array.ndim != len(t.shape) or any(
            d is not None and d != a for d, a in zip(t.shape, array.shape, strict=True)
        ):
            raise FeedError(
                f"cannot feed value of shape {tuple(array.shape)} to {t.op.name!r} "
                f"({t.op.type}), which has shape {shapes.fmt(t.shape)}"
            )
    return array


def _as_list(x) -> list:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _key(f):
    """A hashable identity for a fetch nest (tensors hash by identity)."""
    if isinstance(f, (list, tuple)):
        return (type(f), tuple(_key(x) for x in f))
    if isinstance(f, Mapping):
        return (dict, tuple((k, _key(v)) for k, v in f.items()))
    return f


_tls = threading.local()


def _default_sessions() -> list[Session]:
    if not hasattr(_tls, "stack"):
        _tls.stack = []
    return _tls.stack


def get_default_session() -> Session:
    stack = _default_sessions()
    if not stack:
        raise RuntimeError("no default session: use `with Session() as sess:` or pass session=")
    return stack[-1]


class _SessionDefault:
    def __init__(self, session: Session):
        self.session = session

    def __enter__(self) -> Session:
        _default_sessions().append(self.session)
        return self.session

    def __exit__(self, *exc) -> None:
        _default_sessions().pop()
