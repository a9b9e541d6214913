"""The job as a model script sees it: which task this is, and how many steps it takes.

A script asks the little it needs to know about its job here, and the same calls answer
sensibly in one process: ``task()`` says which slice of the data this task trains on
(``(0, 1)`` alone) and whether it is the chief; ``own_steps``/``steps_done`` turn the
job's global steps into this task's own (all of them alone or in sync mode, a share of
them in async and bounded-staleness modes), so a script that counts from the global step
resumes where the job left off. Everything is read from the environment the launcher and
the operator set (``cluster``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from .cluster import (
    ENV_PS_STRATEGY,
    ENV_TRAINING,
    ENV_VAR,
    PS_STRATEGIES,
    TRAINING_ROLES,
    ClusterSpecError,
    TaskConfig,
    from_env,
)


class TaskInfo(NamedTuple):
    """This process's place among the training tasks: ``index`` of ``count`` (the chief,
    if the job has one, first). Unpacks as ``index, count = task()``."""

    index: int
    count: int

    @property
    def is_chief(self) -> bool:
        """Index 0 initializes the variables, evaluates and reports."""
        return self.index == 0


def training_tasks(config: TaskConfig) -> list[tuple[str, int]]:
    """The tasks that run the model script, in shard order: the chief, then the workers."""
    return [(role, i) for role in TRAINING_ROLES for i in range(config.cluster.num_tasks(role))]


def task(environ: Mapping[str, str] = os.environ) -> TaskInfo:
    """Which shard of the data this process trains on: ``(0, 1)`` in one process."""
    config = from_env(environ)
    if config is None:
        return TaskInfo(0, 1)
    tasks = training_tasks(config)
    if (config.role, config.index) not in tasks:
        raise ClusterSpecError(
            f"{ENV_VAR} names task {config.role}:{config.index}, which runs no model script "
            f"(training tasks are {', '.join(TRAINING_ROLES)})"
        )
    return TaskInfo(tasks.index((config.role, config.index)), len(tasks))


def steps_are_shared(environ: Mapping[str, str]) -> bool:
    """Whether each global step is one step of every worker (alone, or sync mode), not
    one step of one worker (async, bounded staleness)."""
    if from_env(environ) is None:
        return True
    return str(training_config(environ).get("mode") or "async") == "sync"


def own_steps(total: int, environ: Mapping[str, str] = os.environ) -> int:
    """How many steps this task takes while the job takes ``total`` global steps: all of
    them alone or in sync mode, its share of them in async and bounded-staleness modes."""
    if steps_are_shared(environ):
        return total
    index, count = task(environ)
    return total // count + (index < total % count)


def steps_done(global_step: int, environ: Mapping[str, str] = os.environ) -> int:
    """How many of its steps this task had taken when the job stood at ``global_step``:
    where a resumed task starts counting (0 on a fresh start)."""
    if steps_are_shared(environ):
        return global_step
    index, count = task(environ)
    return global_step // count + (index < global_step % count)


def training_done(session, global_step, seen: int, total: int) -> bool:
    """Whether the job has taken its ``total`` global steps, after a step that fetched
    ``seen`` from ``global_step``.

    A read inside a step may run before or after the update that step waits for (in sync
    mode the chief applies it), so after the step the global step is ``seen`` or more.
    Only when that could already be ``total`` is it read again, in a step of its own: the
    last step costs one more round trip, the others nothing. Other workers may still be
    mid-step, so in async modes the job may end up to ``workers - 1`` steps past ``total``.
    """
    return seen + 1 >= total and int(session.run(global_step.value())) >= total


def max_steps(default: int, environ: Mapping[str, str] = os.environ) -> int:
    """The job's ``training.maxSteps`` (global steps), else ``default``."""
    value = training_config(environ).get("maxSteps")
    return default if value is None else int(value)


def numerics_checked(environ: Mapping[str, str] = os.environ) -> bool:
    """The job's ``training.checkNumerics``: whether its sessions check every float output
    of a step for NaN and Inf (off when omitted)."""
    return training_config(environ).get("checkNumerics") is True


def training_config(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The job's training section (mode, backupWorkers, staleness, maxSteps, checkNumerics),
    or ``{}`` when the process runs alone."""
    text = environ.get(ENV_TRAINING)
    if not text:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{ENV_TRAINING} is not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{ENV_TRAINING} must be a JSON object, got {text!r}")
    return config


def ps_strategy(environ: Mapping[str, str] = os.environ) -> str:
    strategy = environ.get(ENV_PS_STRATEGY) or PS_STRATEGIES[0]
    if strategy not in PS_STRATEGIES:
        raise ValueError(
            f"{ENV_PS_STRATEGY} must be one of {', '.join(PS_STRATEGIES)}, got {strategy!r}"
        )
    return strategy
