"""The job's training mode, built by ``minimize``.

``FLOWMILL_TRAINING`` (the manifest's ``training`` section) decides what a training task's
``Optimizer.minimize`` builds: in sync mode the optimizer is wrapped in a
``SyncReplicasOptimizer`` aggregating ``workers - backupWorkers`` gradients per step, in
bounded-staleness mode in ``BoundedStaleness``; this task's worker replica is built, with
its own state on this task. Alone, or in async mode, ``minimize`` is the optimizer's own.
``session_manager.initialize_or_wait`` then starts the mode (the chief loop on the chief).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .cluster import TRAINING_ROLES, TaskConfig, from_env
from .graph import Operation, Tensor
from .job import training_config, training_tasks
from .optimizers import Optimizer
from .replicas import ReplicatedTraining, make_training

# Graph collection of (ReplicatedTraining, worker index) built by ``minimize``.
REPLICAS_COLLECTION = "replicated_training"


def replicated_training(
    optimizer: Optimizer,
    config: TaskConfig | None = None,
    training: Mapping[str, Any] | None = None,
) -> ReplicatedTraining | None:
    """The training mode this task's optimizer runs under, or None where it applies its
    own updates (alone, on a PS task, or in async mode, where nothing coordinates the
    workers). ``config`` and ``training`` default to the process environment."""
    config = from_env() if config is None else config
    if config is None or config.role not in TRAINING_ROLES:
        return None
    training = training_config() if training is None else training
    mode = str(training.get("mode") or "async").replace("-", "_")
    if mode == "async":
        return None
    count = len(training_tasks(config))
    return make_training(
        mode,
        optimizer,
        count,
        backup_workers=int(training.get("backupWorkers") or 0),
        staleness=int(training.get("staleness") or 0),
    )


def replicated_minimize(
    optimizer: Optimizer,
    loss: Tensor,
    global_step=None,
    var_list: Sequence | None = None,
    *,
    config: TaskConfig | None = None,
    training: Mapping[str, Any] | None = None,
) -> Operation | None:
    """This worker's replica of the job's training mode built over ``optimizer`` (the sync
    mode keeps its per-worker state with the global step), or None where the optimizer
    applies its own updates (see ``replicated_training``): the hook for
    ``Optimizer.minimize``."""
    config = from_env() if config is None else config
    replicated = replicated_training(optimizer, config, training)
    if replicated is None:
        return None
    index = training_tasks(config).index((config.role, config.index))
    train_op = replicated.minimize(loss, global_step, var_list, worker_index=index)
    loss.graph.add_to_collection(REPLICAS_COLLECTION, (replicated, index))
    return train_op
