"""``fm.nn``: the neural-network namespace a model script uses, as TensorFlow's ``tf.nn``.

It only gathers names: the ops live by family in ``ops/`` (``nn_ops``, ``activation_ops``,
``nn_impl``, ``top_k_ops``, ``candidate_sampling_ops``) and the sparse functions beside the
modules they build on (``embedding``, ``sampled_softmax``). One namespace module is what
lets ``sampled_softmax`` use ``nn_ops`` without ``nn_ops`` importing it back.
"""

from . import rnn as rnn_cell
from .embedding import embedding_lookup
from .ops.activation_ops import elu, elu_grad, leaky_relu, leaky_relu_grad
from .ops.batch_norm_ops import fused_batch_norm
from .ops.candidate_sampling_ops import log_uniform_candidate_sampler
from .ops.nn_impl import moments, sigmoid_cross_entropy_with_logits
from .ops.nn_ops import (
    avg_pool,
    avg_pool_grad,
    bias_add,
    bias_add_grad,
    conv2d,
    conv2d_backprop_filter,
    conv2d_backprop_input,
    dropout,
    l2_loss,
    log_softmax,
    max_pool,
    max_pool_grad,
    max_pool_grad_grad,
    relu,
    relu_grad,
    sigmoid,
    sigmoid_grad,
    softmax,
    softmax_cross_entropy_with_logits,
    sparse_softmax_cross_entropy_with_logits,
    tanh,
    tanh_grad,
)
from .ops.top_k_ops import in_top_k, top_k
from .rnn import dynamic_rnn, static_rnn
from .sampled_softmax import sampled_softmax_loss

__all__ = [
    "avg_pool",
    "avg_pool_grad",
    "bias_add",
    "bias_add_grad",
    "conv2d",
    "conv2d_backprop_filter",
    "conv2d_backprop_input",
    "dropout",
    "dynamic_rnn",
    "elu",
    "elu_grad",
    "embedding_lookup",
    "fused_batch_norm",
    "in_top_k",
    "l2_loss",
    "leaky_relu",
    "leaky_relu_grad",
    "log_softmax",
    "log_uniform_candidate_sampler",
    "max_pool",
    "max_pool_grad",
    "max_pool_grad_grad",
    "moments",
    "relu",
    "relu_grad",
    "rnn_cell",
    "sampled_softmax_loss",
    "sigmoid",
    "sigmoid_cross_entropy_with_logits",
    "sigmoid_grad",
    "softmax",
    "softmax_cross_entropy_with_logits",
    "sparse_softmax_cross_entropy_with_logits",
    "static_rnn",
    "tanh",
    "tanh_grad",
    "top_k",
]


def __getattr__(name: str):
    from .tf_names import missing

    raise missing("fm.nn", name, __all__)
