"""What a task's server holds and has done, for its ``/progress`` and ``/metrics``.

A PS task runs no training loop, so this is all it has to say: the variables it holds,
the tensors it served its peers, the steps that changed its variables, and the restarts
of its peers it saw. It also keeps the sync accumulators and the staleness clock, and
their state is what names the task holding a stalled job up (``flowmill.operator.stall``):
``sync`` is the pending step of its accumulators and the workers that contributed to it
on every one of them, ``staleness`` each worker's count of finished steps.
"""

from __future__ import annotations

from typing import Any, Protocol

from flowmill.kernels.conditional_accumulator import (
    ConditionalAccumulatorState,
    SparseConditionalAccumulatorState,
    StalenessClockState,
)
from flowmill.kernels.resources import VariableState

from .telemetry import Family


class Serving(Protocol):
    """What of a task's ``Server`` is read here (it stays below the server: no import)."""

    resources: Any
    tensor_server: Any
    updates_applied: int
    peer_restarts_seen: int


def coordination(items: list[tuple[str, Any]]) -> dict[str, Any]:
    """The sync and staleness state among a task's resources (empty when it keeps none).

    Sync: the lowest step any accumulator still waits for, how long it has waited (since
    the last of them moved to it: the job's last progress), how many accumulators there
    are, and the workers with a gradient in every accumulator at that step (one at a later
    step was taken for it already: everyone needed contributed there)."""
    out: dict[str, Any] = {}
    accumulators = (ConditionalAccumulatorState, SparseConditionalAccumulatorState)
    pending = [state.pending() for _, state in items if isinstance(state, accumulators)]
    if pending:
        step = min(p["step"] for p in pending)
        waiting = [p for p in pending if p["step"] == step]
        workers = set(waiting[0]["workers"])
        for p in waiting[1:]:
            workers &= set(p["workers"])
        out["sync"] = {"step": step, "accumulators": len(pending),
                       "waitedSeconds": min(p["waitedSeconds"] for p in waiting),
                       "workers": sorted(workers),
                       "waitingTakes": sum(p["waitingTakes"] for p in pending)}
    clocks = [state for _, state in items if isinstance(state, StalenessClockState)]
    if clocks:
        out["staleness"] = {"finished": clocks[0].clocks(), "waiting": clocks[0].waiting}
    return out


def server_source(server: Serving):
    """A telemetry source (``Telemetry.set_source``) for ``server``'s numbers."""

    def source() -> tuple[dict[str, Any], list[Family]]:
        items = server.resources.items()
        variables = [v for _, v in items if isinstance(v, VariableState)]
        held = sum(getattr(v.value, "nbytes", 0) for v in variables if v.value is not None)
        tensors = server.tensor_server
        fields: dict[str, Any] = {
            "variables": len(variables), "variableBytes": held,
            "valuesServed": tensors.values_sent, "bytesServed": tensors.bytes_sent,
            "updatesApplied": server.updates_applied,
            "peerRestartsSeen": server.peer_restarts_seen,
        }
        fields.update(coordination(items))
        families: list[Family] = [
            ("flowmill_variables", "gauge", "Variables this task holds.", len(variables)),
            ("flowmill_variable_bytes", "gauge", "Bytes of the variables this task holds.",
             held),
            ("flowmill_values_served_total", "counter", "Tensors served to other tasks.",
             tensors.values_sent),
            ("flowmill_bytes_served_total", "counter",
             "Bytes of the tensors served to other tasks.", tensors.bytes_sent),
            ("flowmill_updates_applied_total", "counter",
             "Steps that changed variables held by this task.", server.updates_applied),
            ("flowmill_peer_restarts_seen_total", "counter",
             "Restarts of other tasks this task saw (a session of a newer incarnation).",
             server.peer_restarts_seen),
        ]
        sync = fields.get("sync")
        if sync is not None:
            families.append(("flowmill_sync_pending_step", "gauge",
                             "The step this task's sync accumulators wait for.", sync["step"]))
        return fields, families

    return source
