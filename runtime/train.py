"""``fm.train``: the training namespace a model script uses, as TensorFlow's ``tf.train``.

It only gathers names: the optimizers and the global step from ``optimizers``, the
learning-rate schedules from ``learning_rate``, reading a checkpoint without a graph from
``saver``. Each optimizer also answers to its TensorFlow 1.x name (``AdamOptimizer`` is
``Adam``), the same class.
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
from .saver import list_variables, load_variable

# TensorFlow 1.x's names for the same classes.
AdadeltaOptimizer = Adadelta
AdagradOptimizer = Adagrad
AdamOptimizer = Adam
GradientDescentOptimizer = GradientDescent
MomentumOptimizer = Momentum
RMSPropOptimizer = RMSProp

__all__ = [
    "AdadeltaOptimizer",
    "AdagradOptimizer",
    "AdamOptimizer",
    "GradientDescentOptimizer",
    "MomentumOptimizer",
    "RMSPropOptimizer",
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
    "list_variables",
    "load_variable",
    "piecewise_constant",
]


def __getattr__(name: str):
    from .tf_names import missing

    raise missing("fm.train", name, __all__)
