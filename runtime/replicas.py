"""Data-parallel training modes, built as graph (paper section 4.4, Fig. 4; PMLS's SSP).

Every worker replica runs its own train op on its own slice of the data; the parameters and
whatever coordinates the replicas are ordinary stateful ops placed with the parameters, so
the same graph works in one process (threads as workers) and split over PS and worker tasks.

- **async** (Fig. 4a): each worker applies its update as soon as it has one.
- **sync** (Fig. 4b, 4c): each worker adds its gradients to one accumulator per variable,
  kept with the variable; the chief takes the average of the first ``m`` (of ``n``
  workers), applies it with the wrapped optimizer, bumps the global step, and releases a
  token into each worker's own queue, kept beside the accumulators (``_token_home``). A
  worker takes a token at the end of each step, so its next step starts only once the
  update it contributed to is applied, and it labels its next gradients with the token's
  step (its local step, a local variable kept with its queue): a gradient that arrives
  after its step was taken (a backup worker's, or a straggler's) is dropped and counted.
  With a queue per worker a fast worker cannot take a slow one's token and contribute
  twice to one update, so without backup workers every update averages exactly one
  gradient of each worker and sync training is deterministic.
- **bounded_staleness** (PMLS's stale synchronous parallel): updates are applied at once,
  as in async, but a worker finishing a step reports to a staleness clock and waits there
  until it may start the next: step ``t`` (from 0) may start once every worker has
  finished ``t - s`` steps, so no worker gets more than ``s`` steps ahead of the slowest.

Each mode waits at the *end* of a worker's step, never at its start: the next step's
parameter reads are then ordered after the wait by the step boundary itself, with no
control edge into the model's reads (which the model built before any of this).

The modes share their worker replicas, tokens and chief loop, so they are one file.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from flowmill.kernels.conditional_accumulator import CoordinationClosedError
from flowmill.kernels.fifo_queue import OutOfRangeError, QueueClosedError

from . import dtypes
from .autodiff import IndexedSlices
from .device_names import task_of
from .graph import Graph, Operation, Tensor, convert_to_tensor
from .ops.accumulator_ops import (
    ConditionalAccumulator,
    SparseConditionalAccumulator,
    StalenessClock,
)
from .ops.array_ops import concat, expand_dims, group, identity, no_op, tile
from .ops.data_flow_ops import FIFOQueue
from .ops.math_ops import cast, reduce_max
from .ops.state_ops import GLOBAL_VARIABLES, LOCAL_VARIABLES, Variable
from .optimizers import Optimizer, get_or_create_global_step
from .session import SessionClosedError

MODES = ("async", "sync", "bounded_staleness")
# What a blocked worker or chief sees when the session (or a PS task) goes away.
CLOSED_ERRORS = (SessionClosedError, CoordinationClosedError, QueueClosedError, OutOfRangeError)


@dataclass
class WorkerOps:
    """One worker replica's ops: ``train_op`` once per step. ``init_op`` starts the worker
    at the current global step; run it before the first step whenever the global step may
    not be 0 (after a restore, or a worker that joins late). It is a no-op where the mode
    keeps no per-worker state."""

    index: int
    train_op: Operation
    init_op: Operation
    # bounded staleness: the update alone, and the end of a step (report, then wait), for
    # callers that do something between the two; ``train_op`` is both in order.
    update_op: Operation | None = None
    finish_op: Operation | None = None
    # sync: the step this worker labels its gradients with.
    local_step: Variable | None = None
    # sync: what a worker that comes back into a running job runs instead of ``init_op``:
    # tokens its earlier life left in its queue are dropped (it would label gradients
    # with their old steps), then it starts at the current global step.
    rejoin_op: Operation | None = None


class ReplicatedTraining:
    """Builds each worker's train op over a wrapped optimizer; the modes differ in what
    coordinates the workers. Call ``minimize`` once per worker replica."""

    mode = ""
    has_chief = False  # whether someone must run ``chief_loop`` for training to progress

    def __init__(self, optimizer: Optimizer, num_workers: int, name: str):
        if not isinstance(optimizer, Optimizer):
            raise TypeError(f"{name}: expected an Optimizer to wrap, got {optimizer!r}")
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"{name}: num_workers must be a positive int, got {num_workers!r}")
        self.optimizer = optimizer
        self.num_workers = num_workers
        self._name = name
        self._workers: dict[int, WorkerOps] = {}
        self._global_step: Variable | None = None
        self._graph: Graph | None = None

    @property
    def name(self) -> str:
        return self._name

    # ---- per worker

    def compute_gradients(self, loss, var_list: Sequence[Variable] | None = None):
        return self.optimizer.compute_gradients(loss, var_list)

    def minimize(
        self,
        loss,
        global_step: Variable | None = None,
        var_list: Sequence[Variable] | None = None,
        worker_index: int | None = None,
    ) -> Operation:
        """The train op of one worker replica whose loss is ``loss``.

        ``worker_index`` defaults to the lowest index not yet built.
        """
        grads_and_vars = self.compute_gradients(loss, var_list)
        if all(g is None for g, _ in grads_and_vars):
            names = ", ".join(repr(v.name) for _, v in grads_and_vars)
            raise ValueError(
                f"{self._name}: loss {convert_to_tensor(loss).name} does not depend on any of "
                f"the variables ({names})"
            )
        return self.apply_gradients(grads_and_vars, global_step, worker_index)

    def apply_gradients(
        self,
        grads_and_vars,
        global_step: Variable | None = None,
        worker_index: int | None = None,
    ) -> Operation:
        live = [(g, v) for g, v in grads_and_vars if g is not None]
        if not live:
            raise ValueError(f"{self._name}: no gradients provided for any variable")
        graph = live[0][1].graph
        if self._graph is None:
            self._graph = graph
        elif graph is not self._graph:
            raise ValueError(f"{self._name}: all workers must be built in one graph")
        index = self._claim(worker_index)
        global_step = self._check_global_step(graph, global_step)
        with graph.as_default():
            ops = self._build_worker(graph, live, global_step, index)
        self._workers[index] = ops
        return ops.train_op

    def worker(self, worker_index: int) -> WorkerOps:
        try:
            return self._workers[worker_index]
        except KeyError:
            built = sorted(self._workers) or "none"
            raise KeyError(
                f"{self._name}: worker {worker_index} is not built (built: {built}); "
                "call minimize for it first"
            ) from None

    def train_op(self, worker_index: int) -> Operation:
        return self.worker(worker_index).train_op

    # ---- the chief

    def chief_loop(
        self, session, stop_event: threading.Event | None = None, num_steps: int | None = None
    ) -> int:
        """Drive training from the chief; returns how many updates it applied.

        Nothing to do in this mode: workers apply their own updates.
        """
        return 0

    # ---- helpers

    def _claim(self, worker_index: int | None) -> int:
        if worker_index is None:
            free = [i for i in range(self.num_workers) if i not in self._workers]
            if not free:
                raise ValueError(
                    f"{self._name}: all {self.num_workers} workers are already built"
                )
            return free[0]
        if not isinstance(worker_index, int) or not 0 <= worker_index < self.num_workers:
            raise ValueError(
                f"{self._name}: worker_index must be in [0, {self.num_workers}), "
                f"got {worker_index!r}"
            )
        if worker_index in self._workers:
            raise ValueError(f"{self._name}: worker {worker_index} is already built")
        return worker_index

    def _check_global_step(self, graph: Graph, global_step: Variable | None):
        if self._workers and global_step is not self._global_step:
            raise ValueError(
                f"{self._name}: every worker must use the same global step "
                f"({_var_name(self._global_step)}), got {_var_name(global_step)}"
            )
        self._global_step = global_step
        return global_step

    def _build_worker(self, graph, grads_and_vars, global_step, index) -> WorkerOps:
        raise NotImplementedError


def _var_name(v: Variable | None) -> str:
    return "none" if v is None else repr(v.name)


class AsyncReplicas(ReplicatedTraining):
    """Fig. 4a: each worker applies its update as it arrives; nothing coordinates them."""

    mode = "async"

    def __init__(self, optimizer: Optimizer, num_workers: int, name: str = "async_replicas"):
        super().__init__(optimizer, num_workers, name)

    def _build_worker(self, graph, grads_and_vars, global_step, index):
        with graph.name_scope(f"{self._name}_worker_{index}"):
            train = self.optimizer.apply_gradients(grads_and_vars, global_step=global_step)
            with graph.control_dependencies(None):
                init = no_op(name="init")
        return WorkerOps(index, train, init)


class SyncReplicasOptimizer(ReplicatedTraining):
    """Fig. 4b/4c: aggregate ``replicas_to_aggregate`` gradients per step, then apply once.

    With fewer to aggregate than ``total_num_replicas`` the extra workers are backups: the
    slowest gradients of each step are dropped (``num_dropped`` counts them). Someone, the
    chief, must run ``chief_loop`` (or ``chief_train_op`` in a loop after
    ``chief_init_op``); workers run their ``train_op``.
    """

    mode = "sync"
    has_chief = True

    def __init__(
        self,
        opt: Optimizer,
        replicas_to_aggregate: int,
        total_num_replicas: int | None = None,
        name: str = "sync_replicas",
    ):
        total = replicas_to_aggregate if total_num_replicas is None else total_num_replicas
        super().__init__(opt, total, name)
        if not isinstance(replicas_to_aggregate, int) or replicas_to_aggregate < 1:
            raise ValueError(
                f"{name}: replicas_to_aggregate must be a positive int, "
                f"got {replicas_to_aggregate!r}"
            )
        self.replicas_to_aggregate = replicas_to_aggregate
        self.total_num_replicas = total
        # Tokens each worker gets per update: one, or when aggregating more gradients than
        # there are workers, enough for each to contribute several.
        self.tokens_per_worker = -(-max(total, replicas_to_aggregate) // total)
        self._accumulators: list[tuple[Variable, ConditionalAccumulator, bool]] = []
        self._scope = ""
        self._token_queues: list[FIFOQueue] = []
        self._home = None  # the handle the token queues are colocated with
        self.chief_train_op: Operation | None = None
        self.chief_init_op: Operation | None = None
        self.chief_rejoin_op: Operation | None = None
        self._steps_seen: list[Tensor] = []
        self.num_dropped: Tensor | None = None
        self.num_dropped_by_variable: Tensor | None = None

    @property
    def variables(self) -> list[Variable]:
        return [v for v, _, _ in self._accumulators]

    @property
    def accumulators(self) -> list:
        return [a for _, a, _ in self._accumulators]

    @property
    def token_queues(self) -> list[FIFOQueue]:
        """One per worker, by worker index."""
        self._require_built()
        return self._token_queues

    def _require_built(self) -> None:
        if self.chief_train_op is None:
            raise ValueError(f"{self._name}: build a worker (minimize) first")

    def _check_global_step(self, graph, global_step):
        if global_step is None:
            global_step = self._global_step
            if global_step is None:
                global_step = get_or_create_global_step(graph)
        if global_step.dtype.kind not in "iu":
            raise TypeError(
                f"{self._name}: global step {global_step.name!r} must be an integer variable, "
                f"is {global_step.dtype}"
            )
        return super()._check_global_step(graph, global_step)

    # ---- shared state and the chief's ops, built with the first worker

    def _build_shared(self, graph: Graph, grads_and_vars, global_step: Variable) -> None:
        m = self.replicas_to_aggregate
        with graph.name_scope(None), graph.control_dependencies(None):
            with graph.name_scope(self._name) as scope:
                self._scope = scope
                for g, v in grads_and_vars:
                    sparse = isinstance(g, IndexedSlices)
                    cls = SparseConditionalAccumulator if sparse else ConditionalAccumulator
                    with graph.colocate_with(v.handle):
                        acc = cls(v.dtype, v.shape, name=f"{v.name}/grad_accum")
                    self._accumulators.append((v, acc, sparse))
                self._home = _token_home(global_step, self.variables)
                with graph.colocate_with(self._home):
                    self._token_queues = [
                        FIFOQueue(-1, [dtypes.int64], shapes=[()], name=f"sync_token_q_{i}")
                        for i in range(self.total_num_replicas)
                    ]
                with graph.name_scope("chief"):
                    self.chief_train_op = self._build_chief_step(graph, global_step, m)
                    with graph.colocate_with(global_step.handle):
                        step = self._step_value(global_step.read_value())
                    init = [
                        acc.set_global_step(step) for _, acc, _ in self._accumulators
                    ]
                    init.append(self.get_init_tokens_op())
                    self.chief_init_op = group(*init, name="chief_init")
                    self.chief_rejoin_op = self._build_chief_rejoin(graph, global_step)
                    self._steps_seen = self._build_steps_seen(graph, global_step)
                    dropped = [expand_dims(acc.num_dropped(), 0) for acc in self.accumulators]
                    self.num_dropped_by_variable = concat(dropped, 0, name="num_dropped_by_var")
                    self.num_dropped = reduce_max(self.num_dropped_by_variable, name="num_dropped")

    def _build_steps_seen(self, graph: Graph, global_step: Variable) -> list[Tensor]:
        """The global step and each accumulator's: equal when no update is half done."""
        with graph.colocate_with(global_step.handle):
            steps = [self._step_value(global_step.read_value())]
        for v, acc, _ in self._accumulators:
            with graph.colocate_with(v.handle):
                steps.append(acc.step())
        return steps

    def _build_chief_rejoin(self, graph: Graph, global_step: Variable) -> Operation:
        """What a chief that comes back runs before its chief loop when its earlier life
        left an update half done (taken on some parameter servers, or applied on some,
        without the global step's increment). The update runs wholly on the parameter
        servers once asked for, so that takes a dead chief's update still running when
        the restarted chief's sessions registered, which ends the earlier life's steps
        wherever they stand (with backup workers it may have started well after the
        kill, needing no gradient from the chief's own worker): every accumulator starts
        afresh at the global step and every worker gets a token of that step, so one
        waiting for the update that never came computes its gradients again."""
        with graph.colocate_with(global_step.handle):
            step = self._step_value(global_step.read_value())
        resets = []
        for v, acc, _ in self._accumulators:
            with graph.colocate_with(v.handle):
                resets.append(acc.reset(step))
        with graph.control_dependencies(resets), graph.colocate_with(self._home):
            tokens = tile(expand_dims(step, 0), (self.tokens_per_worker,))
            releases = [q.enqueue_many(tokens) for q in self._token_queues]
        return group(*releases, name="chief_rejoin")

    def _build_chief_step(self, graph: Graph, global_step: Variable, m: int) -> Operation:
        """Wait until every accumulator has its gradients, take every average, then apply
        them (no variable changes before every take has advanced its accumulator, so a
        gradient read from new values is never mixed into the old step), bump the global
        step and release the next step's tokens."""
        # Every accumulator has its gradients before any is taken: a chief that dies before
        # its update leaves every gradient where it was, for the chief that comes back.
        # Waited for last to first: a worker applies its gradients in order, so once the
        # last accumulator of a task is ready the others there are too, and the chief's
        # partition wakes once a round instead of once per variable.
        readies = []
        for v, acc, _ in reversed(self._accumulators):
            with graph.colocate_with(v.handle):
                readies.append(acc.wait_ready(m).op)
        takes = []
        with graph.control_dependencies(readies):
            for v, acc, _ in self._accumulators:
                with graph.colocate_with(v.handle):
                    takes.append(acc.take_grad(m))
        take_ops = [t[0].op if isinstance(t, tuple) else t.op for t in takes]
        aggregated = []
        with graph.control_dependencies(take_ops):
            for (v, _, sparse), t in zip(self._accumulators, takes, strict=True):
                with graph.colocate_with(v.handle):
                    if sparse:
                        indices, values = t
                        aggregated.append(
                            (IndexedSlices(identity(values), identity(indices), v.shape), v)
                        )
                    else:
                        aggregated.append((identity(t), v))
        # The whole update lives on the parameter servers (the optimizer's hyperparameters
        # and its groups with the global step): once the chief has asked for it, no value
        # from the chief's task is needed, so a chief that dies then leaves it done.
        with graph.colocate_with(global_step.handle):
            update = self.optimizer.apply_gradients(aggregated, global_step=global_step)
        with graph.control_dependencies([update]), graph.colocate_with(global_step.handle):
            step = self._step_value(global_step.read_value())
        with graph.colocate_with(self._home):
            tokens = tile(expand_dims(step, 0), (self.tokens_per_worker,))
            releases = [q.enqueue_many(tokens) for q in self._token_queues]
            return group(*releases, name="release_tokens")

    @staticmethod
    def _step_value(step: Tensor) -> Tensor:
        return step if step.dtype == dtypes.int64 else cast(step, dtypes.int64)

    def get_init_tokens_op(self, num_tokens: int | None = None) -> Operation:
        """An op that puts ``num_tokens`` tokens of the current global step in the workers'
        queues, spread over them round robin.

        Needed only when aggregating more gradients than there are workers; the default,
        ``replicas_to_aggregate - total_num_replicas`` (at least 0), is the least that lets
        training progress. More tokens let workers compute on parameters one or more updates
        old, so their gradients may be dropped or mixed into a later step.
        """
        if not self._token_queues:
            raise ValueError(f"{self._name}: build a worker (minimize) first")
        if num_tokens is None:
            num_tokens = max(0, self.replicas_to_aggregate - self.total_num_replicas)
        if num_tokens < 0:
            raise ValueError(f"{self._name}: num_tokens must be >= 0, got {num_tokens}")
        graph = self._token_queues[0].graph
        n = self.total_num_replicas
        if num_tokens == 0:
            with graph.as_default():
                return no_op(name="init_tokens")
        gs = self._global_step
        with graph.as_default(), graph.colocate_with(gs.handle):
            step = self._step_value(gs.read_value())
        with graph.as_default(), graph.colocate_with(self._home):
            puts = []
            for i, queue in enumerate(self._token_queues):
                count = num_tokens // n + (i < num_tokens % n)
                if count:
                    puts.append(queue.enqueue_many(tile(expand_dims(step, 0), (count,))))
            return group(*puts, name="init_tokens")

    # ---- a worker

    def _build_worker(self, graph, grads_and_vars, global_step, index):
        if not self._accumulators:
            self._build_shared(graph, grads_and_vars, global_step)
        self._check_same_variables(grads_and_vars, index)
        by_var = {v: (acc, sparse) for v, acc, sparse in self._accumulators}
        # Who sends, so that a restarted worker's second gradient for a step is a duplicate;
        # unsaid where a worker sends several per step (more to aggregate than workers).
        sender = index if self.tokens_per_worker == 1 else -1
        with graph.name_scope(f"{self._scope}worker_{index}/"):
            # Kept with the token queue, not on the worker: the label it gives the
            # gradients is read, and the token written into it, where both already are,
            # so neither crosses to the worker and back every step. The worker's step
            # then waits for its applies and its token as it waits for any op of a
            # partition: that partition's end.
            with graph.control_dependencies(None), graph.colocate_with(self._home):
                local_step = Variable(0, trainable=False, name="local_step", dtype=dtypes.int64,
                                      collections=[GLOBAL_VARIABLES, LOCAL_VARIABLES])
            label = local_step.value()
            applies = []
            for g, v in grads_and_vars:
                acc, sparse = by_var[v]
                if sparse:
                    applies.append(acc.apply_indexed_slices_grad(g, label, worker=sender))
                else:
                    applies.append(acc.apply_grad(g, label, worker=sender))
            # The token is taken after the applies on its own task but beside those on
            # the others: a token comes only once an update is applied, and the step
            # ends only once all of this worker's applies have run (``train`` joins
            # them), so the token's task waits on no signal from the other variables'
            # tasks. The label is read before the token overwrites it.
            queue = self._token_queues[index]
            with graph.control_dependencies(_on_task_of(queue.handle.op, applies)):
                token = queue.dequeue(name="take_token")
            with graph.control_dependencies([label.op]):
                took = local_step.assign(token, name="take")
            train = group(took, *applies, name="train")
            # A worker's init and rejoin run outside its steps: whatever the caller made its
            # train op wait on (batch-norm updates reading a batch, say) is not theirs.
            with graph.control_dependencies(None):
                with graph.colocate_with(global_step.handle):
                    step = self._step_value(global_step.read_value())
                init = local_step.assign(step, name="init").op
                queue = self._token_queues[index]
                with graph.colocate_with(self._home):
                    stale = queue.dequeue_many(queue.size(), name="drop_stale_tokens")
                with graph.control_dependencies([stale.op]):
                    rejoin = local_step.assign(step, name="rejoin").op
        return WorkerOps(index, train, init, local_step=local_step, rejoin_op=rejoin)

    def _check_same_variables(self, grads_and_vars, index: int) -> None:
        want = {v: sparse for v, _, sparse in self._accumulators}
        got = {v: isinstance(g, IndexedSlices) for g, v in grads_and_vars}
        if got != want:
            missing = [v.name for v in want if v not in got]
            extra = [v.name for v in got if v not in want]
            kinds = [v.name for v in got if v in want and got[v] != want[v]]
            raise ValueError(
                f"{self._name}: worker {index} has gradients for other variables than the "
                f"first worker (missing {missing}, extra {extra}, dense/sparse differs for "
                f"{kinds}); every worker must train the same variables"
            )

    # ---- the chief's loop

    def chief_loop(
        self,
        session,
        stop_event: threading.Event | None = None,
        num_steps: int | None = None,
        initialize: bool = True,
        after_update: Callable[[], None] | None = None,
        rejoin: bool = False,
    ) -> int:
        """Apply aggregated updates until ``num_steps`` are done or ``stop_event`` is set.

        With ``initialize`` it first runs ``chief_init_op`` (accumulators take the global
        step, initial tokens if any): do that once per job, not per call. With ``rejoin``
        it runs ``chief_rejoin_op`` instead, for a chief that comes back into a running
        job. Closing the session wakes a chief blocked on a take: it returns quietly if
        ``stop_event`` was set, else the error propagates. ``after_update`` runs between
        two updates, when no variable changes (a consistent checkpoint is taken there).
        Returns the number of updates applied.
        """
        self._require_built()
        done = 0
        try:
            if rejoin:
                self._rejoin(session)
            elif initialize:
                session.run(self.chief_init_op)
            while num_steps is None or done < num_steps:
                if stop_event is not None and stop_event.is_set():
                    break
                session.run(self.chief_train_op)
                done += 1
                if after_update is not None:
                    after_update()
        except CLOSED_ERRORS:
            if stop_event is not None and stop_event.is_set():
                return done
            raise
        return done


    def _rejoin(self, session) -> None:
        """A chief that comes back into a running job: where every accumulator is at the
        global step (its earlier life died before it took anything), the gradients the
        workers sent stay and no token is given: the update of that step averages them
        with its own worker's (sent again, the same, as duplicates are dropped), exactly
        as without the restart. Otherwise the half-done update is undone as well as can
        be (``chief_rejoin_op``)."""
        steps = [int(s) for s in session.run(self._steps_seen)]
        if any(s != steps[0] for s in steps[1:]):
            print(
                f"flowmill: the update of global step {steps[0]} was half done when the "
                f"chief stopped (accumulators at steps {steps[1:]}): it starts again from "
                "the gradients of that step computed anew",
                file=sys.stderr, flush=True,
            )
            session.run(self.chief_rejoin_op)


class BoundedStaleness(ReplicatedTraining):
    """PMLS's stale synchronous parallel: async updates, but no worker starts step ``t``
    before every worker has finished ``t - staleness`` steps.

    The per-worker step counts live in a ``StalenessClock`` kept with the global step (or,
    without one, with the first variable), so on a parameter server; ``clocks`` reads them.
    """

    mode = "bounded_staleness"

    def __init__(
        self,
        opt: Optimizer,
        num_replicas: int,
        staleness: int = 0,
        name: str = "bounded_staleness",
    ):
        super().__init__(opt, num_replicas, name)
        if not isinstance(staleness, int) or staleness < 0:
            raise ValueError(f"{name}: staleness must be a non-negative int, got {staleness!r}")
        self.staleness = staleness
        self.clock: StalenessClock | None = None
        self.clocks: Tensor | None = None

    def _build_clock(self, graph: Graph, owner: Variable) -> None:
        with graph.name_scope(None), graph.control_dependencies(None):
            with graph.name_scope(self._name), graph.colocate_with(owner.handle):
                self.clock = StalenessClock(self.num_workers, self.staleness)
                self.clocks = self.clock.read(name="clocks")

    def _build_worker(self, graph, grads_and_vars, global_step, index):
        if self.clock is None:
            # With a parameter server, never on a worker: every worker must share one clock.
            owner = global_step if global_step is not None else grads_and_vars[0][1]
            self._build_clock(graph, owner)
        clock = self.clock
        with graph.name_scope(f"{self._name}_worker_{index}"):
            update = self.optimizer.apply_gradients(grads_and_vars, global_step=global_step)
            with graph.control_dependencies(None):
                finish = clock.wait(index, clock.advance(index), name="finish").op
                init = no_op(name="init")
            with graph.control_dependencies([update]):
                train = clock.wait(index, clock.advance(index), name="train").op
        return WorkerOps(index, train, init, update_op=update, finish_op=finish)


def make_training(
    mode: str,
    optimizer: Optimizer,
    num_workers: int,
    backup_workers: int = 0,
    staleness: int = 0,
) -> ReplicatedTraining:
    """The training mode named by configuration.

    ``backup_workers`` (sync only): of ``num_workers``, the slowest this many per step are
    not waited for. ``staleness`` (bounded_staleness only): how many steps a worker may run
    ahead of the slowest.
    """
    if mode not in MODES:
        raise ValueError(f"training mode must be one of {', '.join(MODES)}; got {mode!r}")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
    if backup_workers and mode != "sync":
        raise ValueError(f"backup_workers={backup_workers} applies to sync mode only, not {mode}")
    if staleness and mode != "bounded_staleness":
        raise ValueError(
            f"staleness={staleness} applies to bounded_staleness mode only, not {mode}"
        )
    if mode == "async":
        return AsyncReplicas(optimizer, num_workers)
    if mode == "sync":
        if not isinstance(backup_workers, int) or not 0 <= backup_workers < num_workers:
            raise ValueError(
                f"backup_workers must be in [0, {num_workers}) for {num_workers} workers, "
                f"got {backup_workers!r}"
            )
        return SyncReplicasOptimizer(optimizer, num_workers - backup_workers, num_workers)
    return BoundedStaleness(optimizer, num_workers, staleness)


def _token_home(global_step: Variable, variables: Sequence[Variable]):
    """The resource the token queues and the workers' local steps are kept with: the
    global step, when a variable with an accumulator is on its task, else the last such
    variable. A worker's step then runs on no parameter server beyond those holding its
    gradients' accumulators, and one of them reads its label where it lies. Kept with a
    global step alone on its task, they cost every worker step a run there and its
    label a hop to the accumulators; kept away from it, the chief's release fetches the
    new step from there, one hop a round."""
    step_task = task_of(global_step.device)
    if not variables or any(task_of(v.device) == step_task for v in variables):
        return global_step.handle
    return variables[-1].handle


def _on_task_of(op: Operation, ops: Sequence[Operation]) -> list[Operation]:
    """Those of ``ops`` placed on ``op``'s task, or that may be (either device names no
    task yet)."""
    here = task_of(op.device)
    return [o for o in ops if here is None or task_of(o.device) in (None, here)]


__all__ = [
    "CLOSED_ERRORS",
    "MODES",
    "AsyncReplicas",
    "BoundedStaleness",
    "ReplicatedTraining",
    "SyncReplicasOptimizer",
    "WorkerOps",
    "make_training",
]
