"""The ops partitioning puts on a cut edge: ``_Send`` on the producer's device, ``_Recv``
on the consumer's, meeting in a rendezvous under a key that names both devices, the
tensor and the step. Users never build these; ``partition`` does."""

from __future__ import annotations

from ..op_def import define_op

SENDRECV_ATTRS = {"tensor_name": "", "src_device": "", "dst_device": ""}


@define_op("_Send", attrs=SENDRECV_ATTRS, num_inputs=1, stateful=True, differentiable=False)
def _send_shape(inputs, attrs):
    return []


@define_op(
    "_Recv",
    attrs={**SENDRECV_ATTRS, "dtype": None, "shape": None, "may_be_dead": False},
    num_inputs=0,
    stateful=True,
    differentiable=False,
)
def _recv_shape(inputs, attrs):
    return [(attrs["dtype"], attrs["shape"])]
