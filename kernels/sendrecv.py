"""``_Send``/``_Recv``: hand a value to the step's rendezvous, or wait for one from it.

Both read the per-step ``frame`` (its step id and rendezvous), which the executor passes
to kernels registered with ``frame=True``. A dead value is sent like any other, so the
receiving side learns that a branch was not taken instead of waiting for it.
"""

from __future__ import annotations

from .registry import KernelContext, kernel

_HOST = "the tensor channel moves host memory: a device value is copied to the host first"


def key_prefix(attrs) -> str:
    """A ``_Send``/``_Recv`` pair's rendezvous key without the step id (which ends it)."""
    return f"{attrs['src_device']};{attrs['dst_device']};{attrs['tensor_name']};"


@kernel("_Send", frame=True, host_only=_HOST)
def _send(ctx: KernelContext):
    prefix = key_prefix(ctx.attrs)

    def send(frame, value):
        frame.rendezvous.send(prefix + str(frame.step_id), value)

    return send


@kernel("_Recv", frame=True, host_only=_HOST)
def _recv(ctx: KernelContext):
    prefix = key_prefix(ctx.attrs)

    def recv(frame):
        return frame.rendezvous.recv(prefix + str(frame.step_id))

    return recv
