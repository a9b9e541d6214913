"""``flowmill run JOB.yaml --local``: a TrainingJob as local processes, one per task.

The manifest is the one the operator takes, read and validated by the same code
(``flowmill.operator.api``), and each task gets the environment the operator gives its pod
(``flowmill.operator.manifests.task_env``), except that the cluster spec lists free
loopback ports instead of Service names. PS tasks run the ps template's command (by
default ``python -m flowmill.runtime.server``); the chief and workers run their
container's ``command`` and ``args``, ``$(VAR)`` references expanded as Kubernetes does.
A leading ``python`` is this launcher's own interpreter, so the tasks import the same
Flowmill. Commands run in ``workdir`` when given; else where their relative script path
is found (``find_workdir``): the launcher's working directory, or the manifest's own
directory or the nearest one above it that holds the script, so a repository's manifests
(``command: [python, examples/digits/train.py]``, the path the image's working directory
gives) run from anywhere. The cores the
launcher may use are shared among the tasks (``flowmill.runtime.threads``): each worker
and the chief get an even share as their BLAS/OpenMP thread count, a PS task one, unless
the manifest or the environment sets ``OMP_NUM_THREADS`` (or ``OPENBLAS_NUM_THREADS``,
``MKL_NUM_THREADS``); a line at the start says what each got. With ``FLOWMILL_TRACE``
set to a directory, every task records a step trace there (``flowmill.runtime.trace``)
and the launcher merges them into one file when the job ends.

Life cycle, decided by the operator's own functions (``flowmill.operator.status``), so a
job behaves the same here as on a cluster:

- Success (``spec.successPolicy``): ChiefWorker, the default, when the chief exits 0, or
  without a chief when worker 0 does; AllWorkers when the chief (if any) and every worker
  have. Then whatever still runs is stopped, the PS tasks last: each by SIGTERM (a PS task
  by a ``Shutdown`` call first), then SIGKILL after a grace period; none is left running.
- A failed task (``failure_action``): a worker or the chief under ``restartPolicy``
  OnFailure, or ExitCode with a retryable code (a signal from outside, e.g. SIGKILL), is
  restarted alone: a new process with the same environment and port. A PS task that fails
  or stops early, or any task exiting 75 (``RESTART_JOB_EXIT_CODE``), restarts the whole
  job (on new ports; the tasks resume from their last checkpoint). Under Never, or with a
  permanent code, the job fails: everything is stopped and the task and its code named.
  Every restart, of a task or of the job, counts against ``runPolicy.backoffLimit`` and
  the count is never reset; once it is spent the next failure fails the job. A task that
  was asked to stop (exit 143, ``PREEMPTED_EXIT_CODE``: SIGTERM) is no failure: it runs
  again (the chief by restarting the job from the checkpoint it committed) uncounted; nor
  is a task that found the port picked for it taken by another process (exit 76,
  ``PORT_TAKEN_EXIT_CODE``): the job starts again on new ports, uncounted. A signal is
  reported as Python does (-9 for SIGKILL) and judged as a container's 128 + 9.
- A stalled job (``flowmill.operator.stall``, the operator's rules): once no training task
  has made a step for ``runPolicy.stallTimeoutSeconds`` (or the default derived from the
  step time), the task holding the others up is named and, under its ``restartPolicy``,
  killed and restarted (counted against ``backoffLimit``; Never fails the job).

Every task serves ``/progress`` and ``/metrics`` on a port of its own
(``FLOWMILL_METRICS_PORT``), said in one line at the start of each run: the launcher draws
its one bar from the training tasks', and reads the PS tasks' (their sync state) to tell
who holds a stalled job up.

Ctrl-C (or SIGTERM) stops every task; a second one skips the grace periods.

Each task runs in its own process group (a task's children go with it) and, on Linux,
is killed should the launcher die without stopping it.

The module is long because it is one job's life cycle (plan, start, watch, restart, stop)
over one set of task processes; the decisions in it are the operator's functions, and
what is left is the process handling they drive.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import grpc

from flowmill.operator.api import (
    DEFAULT_PS_COMMAND,
    SpecError,
    TrainingJob,
    main_container_index,
    read_manifest,
)
from flowmill.operator.certificates import write_run
from flowmill.operator.manifests import task_env
from flowmill.operator.stall import (
    Stalled,
    TaskProgress,
    describe_timeout,
    holders,
    quiet_tasks,
    stall_timeout,
)
from flowmill.operator.status import (
    counts_against_backoff,
    failure_action,
    is_chief_task,
    success_reason,
)
from flowmill.runtime.addresses import format_address
from flowmill.runtime.cluster import (
    ENV_METRICS_PORT,
    ENV_PROGRESS,
    ENV_PROGRESS_FINAL,
    ENV_SUMMARY_URI,
    ENV_TLS_DIR,
    ENV_VAR,
    LAUNCHER_IDENTITY,
    METRICS_PATH,
    PORT_TAKEN_EXIT_CODE,
    PROGRESS_PATH,
    TRAINING_ROLES,
    ClusterSpec,
    TaskConfig,
    fetch_progress,
    identity,
)
from flowmill.runtime.protos import task_service_pb2 as pb
from flowmill.runtime.protos import task_service_pb2_grpc as pb_grpc
from flowmill.runtime.remote_rendezvous import CHANNEL_OPTIONS
from flowmill.runtime.threads import divide, explicit, set_count, usable_cores
from flowmill.runtime.tls import TaskCredentials, grpc_channel
from flowmill.runtime.trace import ENV_VAR as TRACE_ENV
from flowmill.runtime.trace import merge as merge_trace

from . import plot
from .progress import JobProgress

LOGS_DIR = "logs"  # summaries of a local run without a summaryUri: logs/<job>
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
START_ATTEMPTS = 3  # a picked port can be taken before its task binds it: start over
POLL_S = 0.05
STALL_CHECK_S = 1.0  # how often the training tasks' snapshots are judged for a stall
_PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")
_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class LaunchError(RuntimeError):
    """The job could not be started (a ps task that never serves)."""


class UnrunnableJobError(LaunchError):
    """The manifest is valid but cannot run here (a task without a command)."""


@dataclass
class Task:
    role: str
    index: int
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen | None = None
    readers: list[threading.Thread] = field(default_factory=list)
    started: float = 0.0  # monotonic time its current process was started
    threads: int = 0  # the BLAS/OpenMP threads it was given
    threads_from: str = ""  # the variable that set them, where the manifest or env did

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


@dataclass
class Outcome:
    code: int  # the launcher's exit status
    message: str
    restart: bool = False
    counted: bool = True  # a restart for it spends runPolicy.backoffLimit (not a preemption's)


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports free right now (a task may still lose one to a race)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined variables are replaced, others stay as
    written, and ``$$`` is a literal ``$``."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, text)


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"exited with code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exited with code {code} (signal {-code})"
    return f"exited with code {code}"


def container_exit_code(code: int) -> int:
    """A process's exit status as a container runtime reports it: 128 + N for signal N
    (Python's -N; 137 for SIGKILL), the code the operator's restart rules are written for."""
    return 128 - code if code < 0 else code


class LocalLauncher:
    """Runs one TrainingJob's tasks as child processes of this one.

    ``out``/``err`` receive every task's stdout/stderr lines prefixed with the task name
    (``[worker-0] ...``); the launcher's own messages go to ``err`` prefixed ``flowmill:``.
    """

    def __init__(
        self,
        job,
        *,
        workdir: str | os.PathLike | None = None,
        python: str = sys.executable,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
        grace: float = 10.0,
        ready_timeout: float = 60.0,
        host: str = "127.0.0.1",
        environ: Mapping[str, str] | None = None,
        cores: int | None = None,
    ):
        self.job = job
        self.workdir = os.fspath(workdir) if workdir is not None else None
        self.python = python
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.grace = grace
        self.ready_timeout = ready_timeout
        self.host = host
        self.environ = dict(os.environ if environ is None else environ)
        # The cores this launcher may use, shared among its tasks (``runtime.threads``).
        self.cores = usable_cores() if cores is None else cores
        # Where training tasks leave their last progress snapshot at exit (the job's bar),
        # made for the length of ``run``.
        self._finals_dir: str | None = None
        # With spec.security.tls: a private directory for the credentials, and those of
        # the current run (a new CA for every run: a restart rotates them), by name.
        self._tls_dir: str | None = None
        self._credentials: dict[str, TaskCredentials] = {}
        self._runs = 0
        self.tasks: list[Task] = []
        self.restarts = 0
        self._write_lock = threading.Lock()
        self._interrupt: int | None = None
        self._hurry = threading.Event()
        self._progress: JobProgress | None = None
        # Where the training tasks write summaries: the job's own (``summary_uri``), else
        # the environment's, else ``logs/<job>`` in the directory the tasks run in.
        self.logs_dir = os.path.join(self.workdir or os.getcwd(), LOGS_DIR, self.job.name)
        self.summary_uri = (self.job.spec.summary_uri() or self.environ.get(ENV_SUMMARY_URI)
                            or self.logs_dir)

    # ---- the whole run

    def run(self) -> int:
        """Run the job to its end; returns the exit status for the command line."""
        spec = self.job.spec
        if spec.run_policy.suspend:
            self.say(f"job {self.job.name} is suspended (spec.runPolicy.suspend); nothing runs")
            return 0
        self._finals_dir = tempfile.mkdtemp(prefix="flowmill-progress-")
        if spec.security.tls:
            self._tls_dir = tempfile.mkdtemp(prefix="flowmill-tls-")
            self.say("tasks talk over mutual TLS, with a new CA for every run "
                     "(spec.security.tls)")
        self.say(f"summaries: {self.summary_uri} (tensorboard --logdir {self.summary_uri})")
        try:
            return self._run_all()
        finally:
            shutil.rmtree(self._finals_dir, ignore_errors=True)
            self._finals_dir = None
            if self._tls_dir is not None:
                shutil.rmtree(self._tls_dir, ignore_errors=True)
                self._tls_dir = None

    def _run_all(self) -> int:
        spec = self.job.spec
        with self._signals():
            while True:
                outcome = self._run_once()
                if not outcome.restart:
                    break
                if outcome.counted:
                    over = self._over_budget(outcome.message)
                    if over is not None:
                        outcome = over
                        break
                    self.restarts += 1
                    budget = f"restart {self.restarts} of {spec.run_policy.backoff_limit}"
                else:
                    budget = "not counted against backoffLimit"
                self.say(
                    f"{outcome.message}: restarting job {self.job.name} from its last "
                    f"checkpoint ({budget})"
                )
        self.say(outcome.message)
        self._merge_trace()
        self._plot_loss()
        return outcome.code

    def _plot_loss(self) -> None:
        """The run's loss curve as ``loss.png`` beside its summaries (a local directory),
        else in ``logs/<job>``: from the chief's scalar summaries, or the bar's losses."""
        local = _local_dir(self.summary_uri)
        curves = plot.loss_curves(plot.read_scalars(local)) if local else {}
        if not curves and self._progress is not None and self._progress.history:
            curves = {"loss (as the launcher's bar read it)": list(self._progress.history)}
        if not curves:
            return
        try:
            path = plot.write_loss_plot(os.path.join(local or self.logs_dir, "loss.png"), curves,
                                        f"TrainingJob {self.job.name}")
        except ImportError:
            self.say("no loss plot: matplotlib is not installed (pip install 'flowmill[plot]')")
        except (OSError, ValueError) as e:
            self.say(f"no loss plot: {e}")
        else:
            self.say(f"loss plot: {path}")

    def _merge_trace(self) -> None:
        """With ``FLOWMILL_TRACE`` set, the tasks' step traces as one file."""
        directory = self.environ.get(TRACE_ENV, "").strip()
        if directory:
            merged = merge_trace(os.path.join(self.workdir or "", directory))
            if merged is not None:
                self.say(f"step trace of every task: {merged} (Perfetto, chrome://tracing)")

    def _issue_credentials(self) -> None:
        """A new CA and certificates for this run's tasks and the launcher (which asks the
        ps tasks whether they serve and tells them to stop)."""
        if self._tls_dir is None:
            return
        for old in os.listdir(self._tls_dir):  # the previous run's
            shutil.rmtree(os.path.join(self._tls_dir, old), ignore_errors=True)
        self._runs += 1
        names = [identity(role, index) for role, index in self.job.spec.tasks()]
        written = write_run(os.path.join(self._tls_dir, f"run-{self._runs}"), self.job.name,
                            [*names, LAUNCHER_IDENTITY])
        self._credentials = {name: TaskCredentials(d) for name, d in written.items()}

    def _channel(self, task: Task) -> grpc.Channel:
        address = TaskConfig.from_json(task.env[ENV_VAR]).address
        return grpc_channel(address, self._credentials.get(LAUNCHER_IDENTITY),
                            identity(task.role, task.index), CHANNEL_OPTIONS)

    def _run_once(self) -> Outcome:
        self._issue_credentials()
        try:
            for attempt in range(START_ATTEMPTS):
                self.tasks = self.plan(free_ports(len(self.job.spec.tasks()), self.host))
                failed = self._start_ps()
                if failed is None:
                    break
                self.stop()
                if attempt == START_ATTEMPTS - 1 or not _lost_port(failed):
                    return Outcome(EXIT_FAILED, self._failure(failed, "at start"))
            if self._interrupt is not None:
                return self._interrupted()
            self.say("task metrics: " + ", ".join(
                f"{t.name} {self._endpoint(t)}{METRICS_PATH}" for t in self.tasks))
            self.say(self.describe_threads())
            for t in self.tasks:
                if t.role != "ps":
                    self._spawn(t)
            return self._watch()
        finally:
            self.stop()

    # ---- what each task runs

    def plan(self, ports: Sequence[int]) -> list[Task]:
        """Every task with its command line and environment, ps tasks first."""

        spec = self.job.spec
        tasks = spec.tasks()
        if len(ports) != len(tasks):
            raise ValueError(f"{len(tasks)} tasks need {len(tasks)} ports, got {len(ports)}")
        by_role: dict[str, list[str]] = {}
        for (role, _), port in zip(tasks, ports, strict=True):
            by_role.setdefault(role, []).append(f"{self.host}:{port}")
        cluster = ClusterSpec.from_dict(by_role)
        metrics_ports = iter(_other_free_ports(len(tasks), ports, self.host))
        shares = divide(self.cores, tasks)
        planned = []
        for role, index in tasks:
            container = self._container(role)
            env = dict(self.environ)
            env.update(_plain_env(container.get("env") or [], env, self.host))
            # CuPy's kernel cache stays where this machine keeps it (the pods' is a volume).
            ours = [e for e in task_env(self.job, role, index) if e["name"] != "CUPY_CACHE_DIR"]
            env.update(_plain_env(ours, env, self.host))
            env[ENV_VAR] = TaskConfig(cluster, role, index).to_json()
            env["PYTHONUNBUFFERED"] = "1"
            env[ENV_METRICS_PORT] = str(next(metrics_ports))
            creds = self._credentials.get(identity(role, index))
            env.pop(ENV_TLS_DIR, None)  # the run's own, or none (not one this shell had)
            if creds is not None:
                env[ENV_TLS_DIR] = creds.directory
            if role != "ps":  # the launcher draws the job's one bar; a task draws none
                env[ENV_PROGRESS] = "off"
                env[ENV_SUMMARY_URI] = self.summary_uri
                if self._finals_dir is not None:
                    env[ENV_PROGRESS_FINAL] = os.path.join(self._finals_dir,
                                                           f"{role}-{index}.json")
            given = explicit(env)
            if given is None:
                source, count = "", shares[(role, index)]
                set_count(env, count)
            else:
                source, count = given
            argv = self._argv(role, container, env)
            planned.append(Task(role, index, argv, env, threads=count, threads_from=source))
        return planned

    def describe_threads(self) -> str:
        """The start line that says what each task got."""
        given = [t for t in self.tasks if t.threads_from]
        line = f"BLAS/OpenMP threads on {self.cores} core(s): " + ", ".join(
            f"{t.name} {t.threads}" + (f" ({t.threads_from})" if t.threads_from else "")
            for t in self.tasks
        )
        if len(given) < len(self.tasks):
            line += " (set OMP_NUM_THREADS in the manifest or the environment to choose)"
        return line

    def _container(self, role: str) -> dict:

        template = self.job.spec.template_for(role)
        return template["spec"]["containers"][main_container_index(template)]

    def _argv(self, role: str, container: Mapping, env: Mapping[str, str]) -> list[str]:

        command = list(container.get("command") or [])
        if not command and role == "ps":
            command = list(DEFAULT_PS_COMMAND)
        if not command:
            i = main_container_index(self.job.spec.template_for(role))
            owner = role if self.job.spec.replica_specs.get(role) is not None else "worker"
            raise UnrunnableJobError(
                f"spec.replicaSpecs.{owner}.template.spec.containers[{i}].command: required "
                f"to run {role} tasks locally (an image's entrypoint is not known here)"
            )
        argv = [expand_vars(str(a), env) for a in command + list(container.get("args") or [])]
        if _PYTHON.match(os.path.basename(argv[0])):
            argv[0] = self.python
        return argv

    # ---- starting

    def _spawn(self, task: Task) -> None:
        task.started = time.monotonic()
        task.proc = subprocess.Popen(
            _guarded(task.argv),
            env=task.env,
            cwd=self.workdir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        for pipe, stream in ((task.proc.stdout, self.out), (task.proc.stderr, self.err)):
            reader = threading.Thread(
                target=self._relay,
                args=(pipe, stream, f"[{task.name}] "),
                name=f"relay-{task.name}",
                daemon=True,
            )
            reader.start()
            task.readers.append(reader)
        if task.role != "ps":
            self._start_progress()

    def _relay(self, pipe: IO[bytes], stream: IO[str], prefix: str) -> None:
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                with self._write_lock:
                    self._erase_progress()
                    stream.write(prefix + line + "\n")
                    stream.flush()

    def _start_ps(self) -> Task | None:
        """Start the ps tasks and wait until each serves; the first one that exits
        instead is returned."""

        ps = [t for t in self.tasks if t.role == "ps"]
        for t in ps:
            self._spawn(t)
        deadline = time.monotonic() + self.ready_timeout
        for t in ps:
            address = TaskConfig.from_json(t.env[ENV_VAR]).address
            with self._channel(t) as channel:
                stub = pb_grpc.TaskServiceStub(channel)
                while True:
                    if t.exit_code() is not None:
                        return t
                    if self._interrupt is not None:
                        return None
                    if time.monotonic() > deadline:
                        raise LaunchError(
                            f"{t.name} did not serve on {address} within {self.ready_timeout:.0f}s"
                        )
                    try:
                        stub.GetStatus(pb.GetStatusRequest(), timeout=0.5, wait_for_ready=True)
                        break
                    except grpc.RpcError:
                        continue
        return None

    # ---- watching

    def _watch(self) -> Outcome:

        spec = self.job.spec
        deadline_s = spec.run_policy.active_deadline_seconds
        started = time.monotonic()
        completed: dict[str, set[int]] = {role: set() for role in TRAINING_ROLES}
        next_stall_check = started + STALL_CHECK_S
        while True:
            if self._interrupt is not None:
                return self._interrupted()
            for t in self.tasks:
                code = t.exit_code()
                if code is None or (t.role in completed and t.index in completed[t.role]):
                    continue
                if code == 0 and t.role in completed:
                    completed[t.role].add(t.index)
                    continue
                outcome = self._on_exit(t, code)
                if outcome is not None:
                    return outcome
            why = success_reason(spec, completed)
            if why:
                running = [t.name for t in self.tasks if t.role != "ps" and t.exit_code() is None]
                stopped = f"; stopped {', '.join(running)}" if running else ""
                return Outcome(0, f"job {self.job.name} succeeded: {why} "
                                  f"(spec.successPolicy {spec.success_policy}){stopped}")
            if deadline_s is not None and time.monotonic() - started > deadline_s:
                return Outcome(
                    EXIT_FAILED,
                    f"job {self.job.name} failed: it ran longer than "
                    f"spec.runPolicy.activeDeadlineSeconds ({deadline_s}s)",
                )
            if time.monotonic() >= next_stall_check:
                next_stall_check = time.monotonic() + STALL_CHECK_S
                outcome = self._check_stall(completed)
                if outcome is not None:
                    return outcome
            time.sleep(POLL_S)

    def _check_stall(self, completed: Mapping[str, set[int]]) -> Outcome | None:
        """Judge the running training tasks' last snapshots; restart the tasks holding a
        stalled job up under their restart policy (or end the run as it says)."""
        progress = self._progress
        if progress is None:
            return None
        now = time.monotonic()
        views = []
        for t in self.tasks:
            if t.role == "ps" or t.exit_code() is not None or t.index in completed[t.role]:
                continue
            snap, fetched = progress.last(t.name)
            if fetched is None or fetched < t.started:  # nothing yet from this process
                snap, fetched = None, now
            views.append(TaskProgress(t.role, t.index, now - t.started, snap, now - fetched))
        spec = self.job.spec
        configured = spec.run_policy.stall_timeout_seconds
        timeout = stall_timeout(configured, views)
        if not quiet_tasks(views, timeout):
            return None
        mode = spec.training.mode
        coordination = []
        if mode != "async":
            coordination = [fetch_progress(f"{self._endpoint(t)}{PROGRESS_PATH}", 2.0)
                            for t in self.tasks if t.role == "ps"]
        found = holders(mode, spec.training_tasks(), views, coordination, timeout,
                        spec.training.backup_workers)
        by_name = {t.name: t for t in self.tasks}
        for stalled in found:
            outcome = self._on_stall(by_name[stalled.name], stalled,
                                     describe_timeout(configured, timeout))
            if outcome is not None:
                return outcome
        return None

    def _on_stall(self, task: Task, stalled: Stalled, limit: str) -> Outcome | None:
        """Kill a stalled task and treat it as failed by SIGKILL under its restart policy."""
        what = f"{task.name} is stalled: {stalled.reason} ({limit})"
        _signal_group(task, signal.SIGKILL)
        task.proc.wait()
        return self._on_exit(task, -signal.SIGKILL, what=what)

    def _on_exit(self, task: Task, code: int, what: str = "") -> Outcome | None:
        """A task that ended without being done (``code`` != 0, or a ps task): restart it
        alone and carry on (None), or end this run, as the operator would decide. ``what``
        says why, where the launcher ended it (a stall)."""

        if code == PORT_TAKEN_EXIT_CODE:  # the port this launcher picked was taken since
            return Outcome(EXIT_FAILED, f"{task.name} found its port taken by another "
                           "process", restart=True, counted=False)
        policy = self.job.spec.replica_specs.get(task.role).restart_policy
        status = container_exit_code(code)
        chief = is_chief_task(self.job, task.role, task.index)
        action = failure_action(task.role, policy, status, chief)
        counted = counts_against_backoff(status)
        if not what:
            what = f"{task.name} {describe_exit(code)}"
            if code == 0:
                what += " before the job finished"
        if action == "restart_job":
            return Outcome(EXIT_FAILED, what, restart=True, counted=counted)
        field = f"spec.replicaSpecs.{task.role}.restartPolicy"
        if action == "fail":
            why = (f"{field} is Never" if policy == "Never" else
                   f"{field} ExitCode treats code {container_exit_code(code)} as permanent")
            return Outcome(EXIT_FAILED, f"job {self.job.name} failed: {what}; {why}")
        if counted:
            over = self._over_budget(what)
            if over is not None:
                return over
            self.restarts += 1
            budget = f"restart {self.restarts} of {self.job.spec.run_policy.backoff_limit}"
        else:
            budget = "preempted: not counted against backoffLimit"
        self.say(f"{what}: restarting it ({budget})")
        _signal_group(task, signal.SIGKILL)  # what it left behind, as a deleted pod would
        self._spawn(task)
        return None

    def _over_budget(self, what: str) -> Outcome | None:
        """The failure that finds ``runPolicy.backoffLimit`` spent (every restart so far, of
        a task or of the job, counted), or None while a restart is left."""
        limit = self.job.spec.run_policy.backoff_limit
        if self.restarts < limit:
            return None
        return Outcome(
            EXIT_FAILED,
            f"job {self.job.name} failed: spec.runPolicy.backoffLimit {limit} reached after "
            f"{self.restarts} restart(s); last failure: {what}",
        )

    def _failure(self, task: Task, when: str = "") -> str:
        code = task.exit_code()
        how = describe_exit(code) if code is not None else "failed"
        return f"job {self.job.name} failed: {task.name} {how}" + (f" {when}" if when else "")

    def _interrupted(self) -> Outcome:
        name = signal.Signals(self._interrupt).name
        return Outcome(EXIT_INTERRUPTED, f"job {self.job.name} stopped ({name})")

    # ---- stopping

    def stop(self) -> None:
        """Stop every task still running: training tasks at once, then the ps tasks
        (``Shutdown``, SIGTERM, SIGKILL, each after the grace period); wait for all."""
        if self._progress is not None:
            self._progress.stop()
        trainers = [t for t in self.tasks if t.role != "ps" and t.exit_code() is None]
        ps = [t for t in self.tasks if t.role == "ps" and t.exit_code() is None]
        _terminate(trainers, self.grace, self._hurry)
        self._shutdown(ps)
        _terminate(ps, self.grace, self._hurry)
        for t in self.tasks:
            for reader in t.readers:
                reader.join(timeout=self.grace)

    def _shutdown(self, ps: list[Task]) -> None:
        if not ps:
            return

        for t in ps:
            with self._channel(t) as channel:
                with contextlib.suppress(grpc.RpcError):
                    pb_grpc.TaskServiceStub(channel).Shutdown(pb.ShutdownRequest(), timeout=2.0)
        _wait_all(ps, self.grace, self._hurry)

    # ---- the job's progress bar

    def _start_progress(self) -> None:
        """Draw the job's bar from its training tasks' endpoints, from the first task
        started until ``stop``."""
        if self._progress is None:
            training = self.job.spec.training
            self._progress = JobProgress(self.job.name, training.mode, training.backup_workers,
                                         self._progress_endpoints, self.err, self._write_lock,
                                         finals=self._final_snapshot)
        self._progress.start()

    def _final_snapshot(self, name: str) -> str | None:
        """The file a training task leaves its last snapshot in at exit."""
        for t in self.tasks:
            if t.name == name:
                return t.env.get(ENV_PROGRESS_FINAL)
        return None

    def _progress_endpoints(self) -> list[tuple[str, str]]:
        """(name, ``/progress`` URL) of every training task, the chief first."""
        return [(t.name, f"{self._endpoint(t)}{PROGRESS_PATH}")
                for t in self.tasks if t.role != "ps" and ENV_METRICS_PORT in t.env]

    def _endpoint(self, task: Task) -> str:
        """The base URL of a task's ``/progress`` and ``/metrics``."""
        return f"http://{format_address(self.host, int(task.env[ENV_METRICS_PORT]))}"

    def _erase_progress(self) -> None:
        """Under the write lock: take the bar off the terminal line before a line is
        written there (it is drawn again on its next round)."""
        if self._progress is not None:
            self._progress.erase()

    # ---- output and signals

    def say(self, message: str) -> None:
        with self._write_lock:
            self._erase_progress()
            self.err.write(f"flowmill: {message}\n")
            self.err.flush()

    @contextlib.contextmanager
    def _signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum, _frame):
            if self._interrupt is not None:  # a second Ctrl-C: no more grace periods
                self._hurry.set()
            self._interrupt = signum

        saved = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)


def _plain_env(entries: Sequence[Mapping[str, Any]], env: Mapping[str, str], host: str):
    """Container env entries as a dict: values expanded, the pod IP is ``host``; entries
    taken from a Secret are left to this process's own environment."""
    out: dict[str, str] = {}
    for e in entries:
        name = e.get("name")
        if not name:
            continue
        if "value" in e:
            out[name] = expand_vars(str(e["value"]), {**env, **out})
        elif (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath") == "status.podIP":
            out[name] = host
    return out


def _local_dir(uri: str) -> str | None:
    """The local directory a summary URI names (a path or ``file://``), else None."""
    if uri.startswith("file://"):
        return urllib.parse.unquote(urllib.parse.urlsplit(uri).path)
    return None if "://" in uri else uri


def _other_free_ports(n: int, taken: Sequence[int], host: str) -> list[int]:
    """``n`` ports free right now and not among ``taken`` (picked but not yet bound)."""
    exclude = set(taken)
    return [p for p in free_ports(n + len(exclude), host) if p not in exclude][:n]


def _lost_port(task: Task) -> bool:
    """A ps task that could not bind its port exits 1 at once: worth another try."""
    return task.exit_code() == 1


def _signal_group(task: Task, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(task.proc.pid, sig)


def _wait_all(tasks: list[Task], timeout: float, hurry: threading.Event) -> bool:
    deadline = time.monotonic() + timeout
    while any(t.exit_code() is None for t in tasks):
        if time.monotonic() > deadline or hurry.is_set():
            return False
        time.sleep(POLL_S)
    return True


def _terminate(tasks: list[Task], grace: float, hurry: threading.Event) -> None:
    """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds (or at once when
    ``hurry`` is set)."""
    tasks = [t for t in tasks if t.proc is not None and t.exit_code() is None]
    for t in tasks:
        _signal_group(t, signal.SIGTERM)
    if not _wait_all(tasks, grace, hurry):
        for t in tasks:
            if t.exit_code() is None:
                _signal_group(t, signal.SIGKILL)
    for t in tasks:
        t.proc.wait()


# What a task's process runs first on Linux: ask the kernel to SIGKILL it when the launcher
# dies (a task may ignore SIGTERM, and nothing is left to stop it gracefully), then become
# the task's command (same pid, environment and process group). A ``preexec_fn`` would do
# this inside the fork, but forking a process that has threads (gRPC's among them) with one
# is not safe: gRPC's fork handlers can hang the fork for good (grpc/grpc#17986), so the
# launcher forks without one and this runs after exec instead. ``-I -S``: the standard
# library alone, never a module of the working directory (the repository's ``operator/``
# would shadow the standard library's); the command it becomes gets the environment as is.
_GUARD = """
import ctypes, os, sys
ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
if os.getppid() != int(sys.argv[1]):
    sys.exit(f"flowmill: the launcher (pid {sys.argv[1]}) is gone; not starting {sys.argv[2]}")
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _guarded(argv: list[str]) -> list[str]:
    """``argv`` to run so that the task dies with the launcher (Linux), else as is."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _GUARD, str(os.getpid()), *argv]


# The image a container without one is given for a local run, where no image is pulled.
LOCAL_IMAGE = "flowmill-local-run"


def with_local_images(doc: Mapping) -> Mapping:
    """``doc`` with every container that names no image given ``LOCAL_IMAGE``: a local run
    starts commands, not images, so a manifest written for it may leave the image out (the
    operator still requires one). A malformed ``doc`` is returned as it is, for the
    validation to name what is wrong."""
    doc = copy.deepcopy(doc)
    try:
        replicas = list(doc["spec"]["replicaSpecs"].values())
    except (KeyError, TypeError, AttributeError):
        return doc
    for replica in replicas:
        try:
            containers = replica["template"]["spec"]["containers"]
        except (KeyError, TypeError):
            continue
        for container in containers if isinstance(containers, list) else ():
            if isinstance(container, dict) and "image" not in container:
                container["image"] = LOCAL_IMAGE
    return doc


def script_path(command: Sequence[str]) -> str | None:
    """The relative script a container command runs: ``python [flags] SCRIPT`` or a
    relative program path itself; None for ``python -c``/``-m``, absolute paths and bare
    program names (found on PATH)."""
    argv = list(command)
    if argv and _PYTHON.match(os.path.basename(argv[0])):
        rest = argv[1:]
        while rest and rest[0].startswith("-"):
            if rest[0] in ("-c", "-m"):
                return None
            rest = rest[1:]
        argv = rest
    if not argv or os.path.isabs(argv[0]) or os.sep not in argv[0]:
        return None
    return argv[0]


def find_workdir(job: TrainingJob, manifest: str, cwd: str | None = None) -> str | None:
    """Where the tasks run when no ``workdir`` is given: None (the current directory)
    when the worker's script is found there or the command names none; else the
    manifest's directory or the nearest directory above it that holds the script."""
    template = job.spec.template_for("worker")
    container = template["spec"]["containers"][main_container_index(template)]
    script = script_path(container.get("command") or [])
    cwd = cwd or os.getcwd()
    if script is None or os.path.exists(os.path.join(cwd, script)):
        return None
    here = os.path.dirname(os.path.abspath(manifest))
    while True:
        if os.path.exists(os.path.join(here, script)):
            return here
        parent = os.path.dirname(here)
        if parent == here:
            return None
        here = parent


def run_manifest(path: str, **options) -> int:
    """Validate the manifest at ``path`` and run it locally; the command line's status."""

    try:
        job = TrainingJob.from_dict(with_local_images(read_manifest(path)), path)
    except SpecError as e:
        err = options.get("err") or sys.stderr
        print(f"flowmill: invalid TrainingJob manifest:\n{e}", file=err)
        return EXIT_USAGE
    if options.get("workdir") is None:
        options["workdir"] = find_workdir(job, path)
    launcher = LocalLauncher(job, **options)
    if options["workdir"] is not None:
        launcher.say(f"tasks run in {options['workdir']} (where the manifest's command is)")
    try:
        return launcher.run()
    except LaunchError as e:
        launcher.say(f"cannot run job {job.name}: {e}")
        return EXIT_USAGE if isinstance(e, UnrunnableJobError) else EXIT_FAILED
