"""The ops placement puts on an edge between a task's host memory and one of its GPUs:
``_HostToDevice`` on the GPU that reads a host value, ``_DeviceToHost`` on the GPU whose
value the host reads, and ``_HostScalar`` where an elementwise GPU kernel takes a host
scalar by value instead; ``_DeviceCopy``, a snapshot on the device of a value a captured
step fetches. Users never build these; ``copies`` and ``cuda_graphs`` do."""

from __future__ import annotations

from ..op_def import define_op, same_as_input

for _name in ("_HostToDevice", "_DeviceToHost", "_HostScalar", "_DeviceCopy"):
    define_op(_name, num_inputs=1, stateful=False, differentiable=False)(same_as_input(0))
