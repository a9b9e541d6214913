"""``fm.train``: the training namespace a model script uses, as TensorFlow's ``tf.train``.

It only gathers names: the optimizers and the global step from ``optimizers``, the
learning-rate schedules from ``learning_rate``.
"""

from .learning_rate import cosine_decay, exponential_decay, piecewise_constant
from .optimizers import (
    GLOBAL_STEP,
    Adadelta,
    Adagrad,
    Adam,
    GradientDescent,
    Momentum,
    Optimizer,
    RMSProp,
    create_global_step,
    get_global_step,
    get_or_create_global_step,
)

__all__ = [
    "GLOBAL_STEP",
    "Adadelta",
    "Adagrad",
    "Adam",
    "GradientDescent",
    "Momentum",
    "Optimizer",
    "RMSProp",
    "cosine_decay",
    "create_global_step",
    "exponential_decay",
    "get_global_step",
    "get_or_create_global_step",
    "piecewise_constant",
]
