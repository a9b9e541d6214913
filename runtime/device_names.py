"""Device and task names, parsed and written in one place (TensorFlow's ``device_name_utils``).

A full device name is ``/job:<role>/task:<index>/device:<TYPE>:<ordinal>``; a partial one
leaves fields open (``/job:ps``, ``/gpu:1``, ``/device:CPU:0``) for a scope or a default
to fill. A task is named by its first two fields, ``/job:<role>/task:<index>``.
"""

from __future__ import annotations

_FIELDS = ("job", "replica", "task", "device")


def parse_device(spec: str) -> dict[str, str]:
    """The fields a (partial) device name sets: ``/job:ps/gpu:1`` ->
    ``{"job": "ps", "device": "GPU:1"}``. ``/cpu:0`` and ``/device:cpu:0`` are the same."""
    out: dict[str, str] = {}
    for part in spec.strip("/").split("/"):
        if not part:
            continue
        key, _, value = part.partition(":")
        key = key.lower()
        if key in ("cpu", "gpu"):
            out["device"] = f"{key.upper()}:{value or 0}"
        elif key == "device":
            kind, _, idx = value.partition(":")
            out["device"] = f"{kind.upper()}:{idx or 0}"
        elif key in ("job", "replica", "task"):
            out[key] = value
        else:
            raise ValueError(f"cannot parse device spec {spec!r} (field {part!r})")
    return out


def merge_device(outer: str, inner: str) -> str:
    """Merge partial device names the way nested ``device`` scopes do: inner fields win."""
    if not outer:
        return inner
    if not inner:
        return outer
    fields = parse_device(outer)
    fields.update(parse_device(inner))
    return "".join(f"/{k}:{fields[k]}" for k in _FIELDS if k in fields)


def complete_device(spec: str, default: str) -> str:
    """Fill the fields ``spec`` leaves open from ``default``.

    ``/job:ps`` with default ``/job:worker/task:1`` -> ``/job:ps/task:1/device:CPU:0``.
    """
    fields = {"job": "localhost", "task": "0", "device": "CPU:0"}
    fields.update(parse_device(default))
    fields.update(parse_device(spec))
    return f"/job:{fields['job']}/task:{fields['task']}/device:{fields['device']}"


def device_type(device: str) -> str:
    """``/job:worker/task:0/device:GPU:1`` -> ``GPU``."""
    return parse_device(device).get("device", "CPU:0").split(":")[0]


def host_of(device: str) -> str:
    """The CPU of the task ``device`` is on: ``/job:w/task:0/device:GPU:1`` ->
    ``/job:w/task:0/device:CPU:0``."""
    fields = parse_device(device)
    fields["device"] = "CPU:0"
    return "".join(f"/{k}:{fields[k]}" for k in _FIELDS if k in fields)


def task_device(role: str, index: int, kind: str = "CPU", ordinal: int = 0) -> str:
    return f"/job:{role}/task:{index}/device:{kind}:{ordinal}"


def task_name(role: str, index: int) -> str:
    return f"/job:{role}/task:{index}"


def split_task(device: str) -> tuple[str, int]:
    """``/job:ps/task:1[/device:CPU:0]`` -> ``("ps", 1)``."""
    fields = parse_device(device)
    if "job" not in fields or not fields.get("task", "").isdigit():
        raise ValueError(f"device {device!r} names no job and task")
    return fields["job"], int(fields["task"])


def task_of(device: str) -> str | None:
    """``/job:ps/task:1/device:CPU:0`` -> ``/job:ps/task:1``; None for a name with no task."""
    try:
        return task_name(*split_task(device))
    except ValueError:
        return None
