"""``fm.summary``: TensorBoard summaries, as TensorFlow 1.x's ``tf.summary``.

It only gathers names: the summary ops from ``ops.summary_ops`` and the event-file writer
from ``summary_writer``. ``Summary`` and ``Event`` are TensorBoard's protos, for a script
that reads a fetched summary (``fm.summary.Summary.FromString(value.tobytes())``); they
load on first use.
"""

from .ops.summary_ops import histogram, image, merge, merge_all, scalar, text
from .summary_writer import FileWriter, job_logdir

# name -> the tensorboard module that defines it
_PROTOS = {
    "Event": "tensorboard.compat.proto.event_pb2",
    "Summary": "tensorboard.compat.proto.summary_pb2",
}

__all__ = [
    "FileWriter", "histogram", "image", "job_logdir", "merge", "merge_all", "scalar", "text",
]
__all__.extend(_PROTOS)


def __getattr__(name: str):
    if name in _PROTOS:
        import importlib

        return getattr(importlib.import_module(_PROTOS[name]), name)
    from .tf_names import missing

    raise missing("fm.summary", name, __all__)
