"""A session's options, as TensorFlow 1.x scripts pass them: ``fm.ConfigProto``.

``gpu_options`` bounds each GPU's memory (``gpu_memory``); the others decide placement:

- ``allow_soft_placement`` (Flowmill's default: True): an op placed on a GPU that has no
  GPU kernel, or on a GPU the task lacks, runs on the CPU, said once per op type. False
  makes that an error naming the ops, as TensorFlow does without soft placement.
- ``log_device_placement``: each step says where each of its ops runs, on standard
  error, when it is compiled (``placement.describe``).
- ``device_count``: at most that many devices of a type, e.g. ``{"GPU": 0}`` keeps a
  session off the GPUs its process has.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GPUOptions:
    """``tf.GPUOptions``: ``per_process_gpu_memory_fraction`` (None: no limit from the
    session, only ``FLOWMILL_GPU_MEMORY_FRACTION``'s if set) and ``allow_growth``."""

    per_process_gpu_memory_fraction: float | None = None
    allow_growth: bool = False


@dataclass
class ConfigProto:
    """``tf.ConfigProto``, as far as Flowmill has options for it (see the module doc)."""

    gpu_options: GPUOptions = field(default_factory=GPUOptions)
    allow_soft_placement: bool = True
    log_device_placement: bool = False
    device_count: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.gpu_options, GPUOptions):
            raise TypeError(f"ConfigProto.gpu_options must be a GPUOptions, "
                            f"got {self.gpu_options!r}")
        for kind, count in self.device_count.items():
            if kind not in ("CPU", "GPU"):
                raise ValueError(f"ConfigProto.device_count: unknown device type {kind!r} "
                                 "(CPU, GPU)")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"ConfigProto.device_count[{kind!r}] must be a count >= 0, "
                                 f"got {count!r}")
        if self.device_count.get("CPU", 1) < 1:
            raise ValueError("ConfigProto.device_count['CPU'] must be at least 1: every task "
                             "has its CPU")


def usable_gpus(config: ConfigProto | None, available: int) -> int:
    """How many of the task's ``available`` GPUs a session with ``config`` may use."""
    if config is None:
        return available
    return min(available, config.device_count.get("GPU", available))
