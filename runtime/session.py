"""Sessions: run steps of a graph. Each distinct (fetches, feeds, targets) is pruned,
optimized and compiled once; later runs of it only execute the cached plan.

``BaseSession`` is that core, written once; ``Session`` compiles a step for this process
and ``distributed.DistributedSession`` for a cluster. Nothing else tells them apart: both
answer ``is_chief``, ``task``, ``closed`` and ``variable_device``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

from flowmill.kernels import ARRAY_MODULES, DEAD, shapes
from flowmill.kernels.resources import Resources

from . import cuda_graphs, hooks, passes, trace
from .copies import insert_copies
from .device_names import parse_device, task_name
from .executor import Plan, compile_step
from .fusion import fuse_elementwise
from .gpu_memory import limit_gpu_memory
from .graph import (
    Graph,
    Operation,
    Tensor,
    default_sessions,
    get_default_graph,
)
from .local_devices import gpu_count
from .placement import log_placement, place
from .prune import prune
from .session_config import ConfigProto, usable_gpus
from .step_graph import StepGraph


class SessionClosedError(RuntimeError):
    pass


class FeedError(ValueError):
    pass


class _Fetches:
    """Flattens a nest of fetches (tensor, op, name, list, tuple, named tuple, dict) and
    rebuilds it."""

    def __init__(self, graph: Graph, fetches: Any):
        self.tensors: list[Tensor] = []
        self.targets: list[Operation] = []
        self.structure = self._flatten(graph, fetches)

    def _flatten(self, graph, f):
        if f is None:
            return None
        if isinstance(f, (list, tuple)):
            return _same_kind(f, [self._flatten(graph, x) for x in f])
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
        return _same_kind(s, [self.rebuild(values, x, False) for x in s])


def _same_kind(like: list | tuple, items: list):
    """``items`` as a list, tuple or named tuple (an LSTM's state), as ``like`` is."""
    return type(like)(*items) if hasattr(like, "_fields") else type(like)(items)


class BaseSession:
    """What every session does the same way: fetch and feed handling, one compiled step per
    (fetches, feeds, targets), ``make_callable``, being the default, close hooks.

    A subclass says only how a step is compiled (``_compile_step``: a pruned, optimized
    ``StepGraph`` to something with ``mapper``, the fetch nest, and ``plan``, the plan
    that takes the feeds) and how it runs (``_run_step``), and where a variable lives
    (``variable_device``). With ``check_numerics`` it compiles every step with a check
    after each float output (``passes.add_numerics_checks``), where its devices are known.
    ``config`` (``ConfigProto``) limits how much of each GPU the process may use
    (``gpu_memory``; without it ``FLOWMILL_GPU_MEMORY_FRACTION`` does, if set) and how
    steps are placed (``session_config``)."""

    is_chief = True  # initializes, saves and reports for the job (alone: always)
    task = task_name("localhost", 0)

    def __init__(
        self, graph: Graph | None, resources: Resources, optimize: bool, check_numerics: bool,
        config: ConfigProto | None = None,
    ):
        limit_gpu_memory(config)  # before any step puts an array on a GPU
        self.session_config = config or ConfigProto()
        self.graph = graph or get_default_graph()
        self.resources = resources
        self.optimize = optimize
        self.check_numerics = check_numerics
        self._plans: dict[tuple, Any] = {}
        self._compile_lock = threading.Lock()
        self._closed = False

    # ---- what a session is made of
    def _compile_step(self, step: StepGraph, mapper: _Fetches):
        raise NotImplementedError

    def _run_step(self, compiled, args: tuple, plan_key: tuple | None) -> tuple:
        raise NotImplementedError

    def variable_device(self, op: Operation) -> str:
        """The device a variable's op (or an op colocated with one) runs on."""
        raise NotImplementedError

    # ---- running
    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError(f"attempted to use a closed {type(self).__name__}")

    def run(self, fetches, feed_dict: Mapping | None = None, targets=None):
        if self._closed:
            self._check_open()
        feed_dict = feed_dict or {}
        feed_keys = tuple(self._feed_tensor(k) for k in feed_dict)
        plan_key = (_key(fetches), feed_keys, _key(targets))
        compiled = self._plans.get(plan_key)
        if compiled is None:
            compiled = self._compile(fetches, feed_keys, targets, plan_key)
        args = tuple(
            convert_feed(t, v) for t, v in zip(feed_keys, feed_dict.values(), strict=True)
        )
        values = self._run_step(compiled, args, plan_key)
        for i, v in enumerate(values):
            if v is DEAD:
                raise ValueError(
                    f"fetched tensor {compiled.mapper.tensors[i].name} is dead: it is on a "
                    "branch that this step did not take"
                )
        return compiled.mapper.rebuild(values)

    def make_callable(self, fetches, feed_list=(), targets=None):
        """A function taking the feeds positionally; it skips the plan lookup of ``run``."""
        self._check_open()
        feed_keys = tuple(self._feed_tensor(k) for k in feed_list)
        compiled = self._compile(fetches, feed_keys, targets, None)
        run_step, rebuild = self._run_step, compiled.mapper.rebuild

        def call(*feed_values):
            if self._closed:  # checked inline: this is the step's hot path
                self._check_open()
            args = tuple(convert_feed(t, v) for t, v in zip(feed_keys, feed_values, strict=True))
            return rebuild(run_step(compiled, args, None))

        call.plan = compiled.plan
        return call

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
            compiled = self._compile_step(step, mapper)
            if plan_key is not None:
                self._plans[plan_key] = compiled
            return compiled

    # ---- being the default, closing
    def as_default(self):
        return _SessionDefault(self)

    def __enter__(self):
        default_sessions().append(self)
        self._graph_ctx = self.graph.as_default()
        self._graph_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._graph_ctx.__exit__(*exc)
        default_sessions().pop()
        self.close()

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the session closes, while it can still run steps (the final
        checkpoint of a job is taken this way)."""
        self.__dict__.setdefault("_close_hooks", []).append(hook)

    def close(self) -> None:
        """Run the close hooks (newest first), then release the session; it closes even
        if a hook fails (that error propagates)."""
        if self._closed:
            return
        try:
            hooks = self.__dict__.pop("_close_hooks", [])
            errors = []
            for hook in reversed(hooks):
                try:
                    hook()
                except Exception as e:  # noqa: BLE001 - re-raised below, after the others ran
                    errors.append(e)
            if errors:
                raise errors[0]
        finally:
            self._closed = True
            self._plans.clear()
            self._release()

    def _release(self) -> None:
        """What closing frees beyond the plans (the session is marked closed already)."""


class _LocalPlan(NamedTuple):
    plan: Plan
    mapper: _Fetches


class Session(BaseSession):
    """Runs steps against one graph in this process, holding its variables and queues.

    In a process started as a training task of a cluster (``FLOWMILL_CONFIG`` names a
    worker or the chief), ``Session(...)`` returns that task's ``DistributedSession``
    instead (``hooks.cluster_session``), so a model script runs unchanged alone or in a
    job. Subclasses are never redirected.

    ``cuda_graphs=True``, where the process has a GPU, captures the GPU work of each step
    (on one GPU, outside loops, between host synchronizations) as CUDA graphs, one per
    segment between them, on their third run of an input shape, and replays them from
    then on (``cuda_graphs.py``).

    ``check_numerics=True`` fails a step at the first op whose float output holds a NaN or
    Inf, with an ``InvalidArgumentError`` naming the op, its type and its inputs' shapes,
    before anything downstream of it runs. Off, the compiled steps are as without it.
    """

    def __new__(cls, *args, **kwargs):
        if cls is Session and hooks.cluster_session is not None:
            session = hooks.cluster_session(*args, **kwargs)
            if session is not None:
                return session
        return super().__new__(cls)

    def __init__(
        self, graph: Graph | None = None, optimize: bool = True, check_numerics: bool = False,
        cuda_graphs: bool = False, config: ConfigProto | None = None,
    ):
        super().__init__(graph, Resources(), optimize, check_numerics, config)
        self.cuda_graphs = cuda_graphs

    def _compile_step(self, step: StepGraph, mapper: _Fetches) -> _LocalPlan:
        config = self.session_config
        gpus = usable_gpus(config, gpu_count())
        if gpus or not config.allow_soft_placement or config.log_device_placement:
            # jobs and tasks mean nothing in one process; device types do
            for n in step.nodes:
                kind = parse_device(n.device).get("device")
                n.device = f"/device:{kind}" if kind else ""
            place(step, task_name("localhost", 0), gpus, soft=config.allow_soft_placement)
            log_placement(step, config)
        if self.check_numerics:
            passes.add_numerics_checks(step)
        insert_copies(step)
        fuse_elementwise(step)
        plan = compile_step(step, self.resources)
        if self.cuda_graphs and gpus:
            plan = cuda_graphs.graphed(step, plan, self.resources, ARRAY_MODULES["GPU"])
        return _LocalPlan(plan, mapper)

    def _run_step(self, compiled: _LocalPlan, args: tuple, plan_key) -> tuple:
        if trace.TRACER is not None:
            with trace.TRACER.span("step", "session"):
                return compiled.plan.run(args)
        return compiled.plan.run(args)

    def variable_device(self, op: Operation) -> str:
        """What the script asked for: in one process nothing is placed beyond that."""
        if op.colocation:
            op = self.graph.get_operation_by_name(op.colocation[0])
        return op.device

    def _release(self) -> None:
        self.resources.close()


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


def convert_feed(t: Tensor, value) -> np.ndarray:
    """``value`` as the array placeholder ``t`` takes, or a ``FeedError`` naming it: the
    one check of fed values, for sessions and for exported models alike."""
    if t.dtype.kind == "O":
        return value
    array = value if type(value) is np.ndarray and value.dtype == t.dtype else None
    if array is None:
        try:
            given = np.asarray(value)
            with np.errstate(over="ignore", invalid="ignore"):  # judged just below
                array = (given.astype(t.dtype, copy=False) if given.dtype.kind != "O"
                         else np.asarray(value, dtype=t.dtype))
        except (TypeError, ValueError, OverflowError) as e:
            raise FeedError(
                f"cannot feed {type(value).__name__} to {t.name} ({t.dtype}): {e}"
            ) from None
        _check_converted(t, given, array)
    if t.shape is not None:
        if array.ndim != len(t.shape) or any(
            d is not None and d != a for d, a in zip(t.shape, array.shape, strict=True)
        ):
            raise FeedError(
                f"cannot feed value of shape {tuple(array.shape)} to {t.op.name!r} "
                f"({t.op.type}), which has shape {shapes.fmt(t.shape)}"
            )
    return array


def _check_converted(t: Tensor, given: np.ndarray, array: np.ndarray) -> None:
    """A feed whose values the placeholder's dtype would change is refused: fractions or
    out-of-range numbers into integers, finite numbers that overflow a float. (Rounding
    to a float's precision is what a float placeholder is for.)"""
    kind, was = t.dtype.kind, given.dtype.kind
    with np.errstate(invalid="ignore", over="ignore"):
        if kind in "iu" and was in "iuf":
            changed = array != given
        elif kind == "f" and was in "iuf":
            changed = np.isinf(array) & np.isfinite(given)
        else:
            return
    if changed.any():
        first = tuple(np.argwhere(changed)[0]) if given.ndim else ()
        raise FeedError(
            f"cannot feed {given.dtype} values to {t.op.name!r} ({t.dtype}): "
            f"{given[first].item()!r} does not fit {t.dtype} (it would become "
            f"{array[first].item()!r})"
        )


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


class _SessionDefault:
    def __init__(self, session: BaseSession):
        self.session = session

    def __enter__(self) -> BaseSession:
        default_sessions().append(self.session)
        return self.session

    def __exit__(self, *exc) -> None:
        default_sessions().pop()
