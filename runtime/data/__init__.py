"""``fm.data``: input pipelines in the spirit of TensorFlow's ``tf.data`` (1.x API).

    ds = fm.data.Dataset.from_tensor_slices((x, y)).shuffle(10000, seed=0).repeat()
    images, labels = ds.batch(128).prefetch(2).make_one_shot_iterator().get_next()
    train_op = model(images, labels)        # sess.run(train_op): no feed_dict

The modules: ``structure`` (elements and their checks), ``streams`` (opened datasets and
their threads), ``dataset`` (the ``Dataset`` methods), ``sources``, ``mapping``,
``transformations``, and ``iterator`` (the graph side: ``get_next`` as an op, the job's
default shard, the position a restored job resumes at; its docstring gives the design).
"""

from __future__ import annotations

from flowmill.kernels.fifo_queue import OutOfRangeError

from . import mapping, transformations  # noqa: F401  (they register Dataset's methods)
from .dataset import AUTOTUNE, Dataset
from .iterator import Iterator
from .sources import FixedLengthRecordDataset, TextLineDataset
from .structure import INFINITE, UNKNOWN

INFINITE_CARDINALITY = INFINITE
UNKNOWN_CARDINALITY = UNKNOWN

__all__ = [
    "AUTOTUNE",
    "Dataset",
    "FixedLengthRecordDataset",
    "INFINITE_CARDINALITY",
    "Iterator",
    "OutOfRangeError",
    "TextLineDataset",
    "UNKNOWN_CARDINALITY",
]
