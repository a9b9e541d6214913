"""Neural-network ops: activations, softmax and cross-entropy, bias, 2-D convolution, pooling.

Layouts are TensorFlow's defaults: images NHWC, filters HWIO. The backward passes of
activations, convolution and pooling are ops of their own (``ReluGrad``, ``Conv2DBackpropInput``,
``MaxPoolGrad``...), as in TensorFlow, so a gradient step runs one fused kernel per layer
instead of a chain of elementwise ops. Each backward op has a gradient too, so second
derivatives work. Where TensorFlow passes a shape as a tensor (``input_sizes``,
``orig_input_shape``), these ops take a tensor of that shape instead: its values are never
read, and the shape stays right when the batch size is known only at run time.

Like TensorFlow's ``nn_ops.py``, one op family per file, each op's definition, shape
function, constructor and gradient side by side: the file is long because the family is.
"""

from __future__ import annotations

from flowmill.kernels import shapes
from flowmill.kernels.shapes import ShapeError

from ..autodiff import defvjp
from ..graph import Tensor, apply_op, convert_to_tensor
from ..op_def import define_op, require_float, require_same_dtype, same_as_input
from .array_ops import identity
from .array_ops import shape as shape_of
from .debug_ops import assert_less, assert_non_negative
from .math_ops import broadcast_to_shape_of, cast, exp, greater_equal, reduce_sum
from .random_ops import random_uniform


def _out(op_type: str, inputs: list, attrs: dict | None = None, name: str | None = None) -> Tensor:
    return apply_op(op_type, inputs, attrs, name).outputs[0]


# ---- shape-function helpers


def _rank_at_least(t: Tensor, rank: int, what: str) -> None:
    if t.shape is not None and len(t.shape) < rank:
        raise ShapeError(f"{what} must have rank >= {rank}, has shape {shapes.fmt(t.shape)}")


def _rank_exactly(t: Tensor, rank: int, what: str) -> None:
    if t.shape is not None and len(t.shape) != rank:
        raise ShapeError(f"{what} must have rank {rank}, has shape {shapes.fmt(t.shape)}")


def _merge_dim(a: int | None, b: int | None, why: str) -> int | None:
    if a is not None and b is not None and a != b:
        raise ShapeError(why)
    return a if a is not None else b


def _float_unary(inputs, attrs):
    require_float(inputs[0])
    return [(inputs[0].dtype, inputs[0].shape)]


def _float_pair(inputs, attrs):
    """Two same-shaped float tensors (a backward op's forward value and incoming gradient)."""
    a, b = inputs
    dtype = require_same_dtype(inputs)
    if dtype.kind != "f":
        raise ShapeError(f"expected floating-point inputs, got {dtype}")
    if not shapes.compatible(a.shape, b.shape):
        raise ShapeError(f"shapes differ: {shapes.fmt(a.shape)} vs {shapes.fmt(b.shape)}")
    return [(dtype, shapes.merge(a.shape, b.shape))]


def _spatial(attrs: dict, key: str) -> tuple[int, int]:
    """(height, width) of a 4-tuple NHWC attr such as strides, ksize or dilations."""
    value = attrs[key]
    if (
        not isinstance(value, tuple)
        or len(value) != 4
        or not all(isinstance(v, int) and v > 0 for v in value)
    ):
        raise ShapeError(f"attr {key} must be 4 positive ints (N, H, W, C), got {value!r}")
    if value[0] != 1 or value[3] != 1:
        raise ShapeError(f"attr {key}={value}: batch and channel entries must be 1")
    return value[1], value[2]


def _padding(attrs: dict) -> str:
    padding = attrs["padding"]
    if padding not in ("SAME", "VALID"):
        raise ShapeError(f"attr padding must be 'SAME' or 'VALID', got {padding!r}")
    return padding


def _window_out(
    size: int | None, k: int | None, stride: int, dilation: int, padding: str, what: str
) -> int | None:
    """Output length of a sliding window along one axis (TensorFlow's SAME/VALID rules)."""
    if size is None:
        return None
    if padding == "SAME":
        return -(-size // stride)
    if k is None:
        return None
    span = (k - 1) * dilation + 1
    if size < span:
        raise ShapeError(f"{what}: VALID window of extent {span} does not fit in input size {size}")
    return (size - span) // stride + 1


def _out_hw(x_shape, k_hw, attrs, dilations=(1, 1)) -> tuple:
    sh, sw = _spatial(attrs, "strides")
    padding = _padding(attrs)
    if x_shape is None:
        return (None, None)
    return (
        _window_out(x_shape[1], k_hw[0], sh, dilations[0], padding, "height"),
        _window_out(x_shape[2], k_hw[1], sw, dilations[1], padding, "width"),
    )


def _check_out_backprop(g: Tensor, want: tuple, what: str) -> tuple:
    _rank_exactly(g, 4, f"{what} out_backprop")
    if g.shape is None:
        return want
    if not shapes.compatible(g.shape, want):
        raise ShapeError(
            f"{what}: out_backprop has shape {shapes.fmt(g.shape)}, "
            f"the forward op's output has shape {shapes.fmt(want)}"
        )
    return shapes.merge(g.shape, want)


# ---- activations


define_op("Relu", num_inputs=1)(same_as_input())
define_op("Sigmoid", num_inputs=1)(_float_unary)
define_op("Tanh", num_inputs=1)(_float_unary)


@define_op("ReluGrad", num_inputs=2)
def _relu_grad_shape(inputs, attrs):
    g, y = inputs
    require_same_dtype(inputs)
    if not shapes.compatible(g.shape, y.shape):
        raise ShapeError(f"shapes differ: {shapes.fmt(g.shape)} vs {shapes.fmt(y.shape)}")
    return [(g.dtype, shapes.merge(g.shape, y.shape))]


define_op("SigmoidGrad", num_inputs=2)(_float_pair)
define_op("TanhGrad", num_inputs=2)(_float_pair)


def relu(features, name=None) -> Tensor:
    return _out("Relu", [convert_to_tensor(features)], name=name)


def sigmoid(x, name=None) -> Tensor:
    return _out("Sigmoid", [convert_to_tensor(x)], name=name)


def tanh(x, name=None) -> Tensor:
    return _out("Tanh", [convert_to_tensor(x)], name=name)


def relu_grad(gradients, outputs, name=None) -> Tensor:
    """``gradients`` where the Relu's output is positive, else 0."""
    return _out("ReluGrad", [gradients, outputs], name=name)


def sigmoid_grad(outputs, gradients, name=None) -> Tensor:
    """``gradients * y * (1 - y)`` with ``y`` the Sigmoid's output."""
    return _out("SigmoidGrad", [outputs, gradients], name=name)


def tanh_grad(outputs, gradients, name=None) -> Tensor:
    """``gradients * (1 - y**2)`` with ``y`` the Tanh's output."""
    return _out("TanhGrad", [outputs, gradients], name=name)


@defvjp("Relu")
def _relu_vjp(op, g):
    return [relu_grad(g, op.outputs[0])]


@defvjp("Sigmoid")
def _sigmoid_vjp(op, g):
    return [sigmoid_grad(op.outputs[0], g)]


@defvjp("Tanh")
def _tanh_vjp(op, g):
    return [tanh_grad(op.outputs[0], g)]


@defvjp("ReluGrad")
def _relu_grad_vjp(op, h):
    # Piecewise linear in the gradient; the mask from y is constant almost everywhere.
    return [relu_grad(h, op.inputs[1]), None]


@defvjp("SigmoidGrad")
def _sigmoid_grad_vjp(op, h):
    y, g = op.inputs
    hg = h * g
    return [hg - 2.0 * hg * y, sigmoid_grad(y, h)]


@defvjp("TanhGrad")
def _tanh_grad_vjp(op, h):
    y, g = op.inputs
    return [-2.0 * h * g * y, tanh_grad(y, h)]


# ---- bias


@define_op("BiasAdd", num_inputs=2)
def _bias_add_shape(inputs, attrs):
    x, b = inputs
    dtype = require_same_dtype(inputs)
    _rank_at_least(x, 2, "BiasAdd value")
    _rank_exactly(b, 1, "BiasAdd bias")
    if x.shape is None:
        return [(dtype, None)]
    c = x.shape[-1]
    if b.shape is not None:
        c = _merge_dim(
            c, b.shape[0],
            f"bias of shape {shapes.fmt(b.shape)} does not match the last dim of value "
            f"{shapes.fmt(x.shape)}",
        )
    return [(dtype, x.shape[:-1] + (c,))]


@define_op("BiasAddGrad", num_inputs=1)
def _bias_add_grad_shape(inputs, attrs):
    (g,) = inputs
    _rank_at_least(g, 2, "BiasAddGrad out_backprop")
    return [(g.dtype, (None,) if g.shape is None else (g.shape[-1],))]


def bias_add(value, bias, data_format=None, name=None) -> Tensor:
    """``value + bias`` with ``bias`` added along the last (channel) dimension."""
    if data_format not in (None, "NHWC", "N...C"):
        raise ValueError(f"bias_add: only channels-last data is supported, got {data_format!r}")
    value = convert_to_tensor(value)
    bias = convert_to_tensor(bias, dtype=value.dtype if not isinstance(bias, Tensor) else None)
    return _out("BiasAdd", [value, bias], name=name)


def bias_add_grad(out_backprop, name=None) -> Tensor:
    """The bias gradient: ``out_backprop`` summed over every axis but the last."""
    return _out("BiasAddGrad", [out_backprop], name=name)


@defvjp("BiasAdd")
def _bias_add_vjp(op, g):
    return [g, bias_add_grad(g)]


@defvjp("BiasAddGrad")
def _bias_add_grad_vjp(op, h):
    return [broadcast_to_shape_of(h, op.inputs[0])]


# ---- softmax and cross-entropy


def _last_axis_shape(inputs, attrs):
    (x,) = inputs
    require_float(x)
    _rank_at_least(x, 1, "softmax logits")
    return [(x.dtype, x.shape)]


define_op("Softmax", num_inputs=1)(_last_axis_shape)
define_op("LogSoftmax", num_inputs=1)(_last_axis_shape)


def _check_axis(fn: str, axis) -> None:
    if axis not in (None, -1):
        raise ValueError(f"{fn}: only the last axis is supported, got axis={axis!r}")


def softmax(logits, axis=None, name=None) -> Tensor:
    """exp(logits) / sum(exp(logits)) along the last axis, shifted by the max for stability."""
    _check_axis("softmax", axis)
    return _out("Softmax", [convert_to_tensor(logits)], name=name)


def log_softmax(logits, axis=None, name=None) -> Tensor:
    _check_axis("log_softmax", axis)
    return _out("LogSoftmax", [convert_to_tensor(logits)], name=name)


@defvjp("Softmax")
def _softmax_vjp(op, g):
    return [_softmax_vjp_of(op.outputs[0], g)]


@defvjp("LogSoftmax")
def _log_softmax_vjp(op, g):
    return [g - exp(op.outputs[0]) * reduce_sum(g, axis=-1, keepdims=True)]


@define_op("SoftmaxCrossEntropyWithLogits", num_inputs=2)
def _xent_shape(inputs, attrs):
    logits, labels = inputs
    dtype = require_same_dtype(inputs)
    require_float(logits)
    _rank_at_least(logits, 1, "logits")
    if not shapes.compatible(logits.shape, labels.shape):
        raise ShapeError(
            f"logits {shapes.fmt(logits.shape)} and labels {shapes.fmt(labels.shape)} "
            "must have the same shape"
        )
    shape = shapes.merge(logits.shape, labels.shape)
    return [(dtype, None if shape is None else shape[:-1]), (dtype, shape)]


@define_op("SparseSoftmaxCrossEntropyWithLogits", num_inputs=2)
def _sparse_xent_shape(inputs, attrs):
    logits, labels = inputs
    require_float(logits)
    if labels.dtype.kind not in "iu":
        raise ShapeError(f"labels must be integer class indices, got {labels.dtype}")
    _rank_at_least(logits, 1, "logits")
    batch = None if logits.shape is None else logits.shape[:-1]
    if not shapes.compatible(batch, labels.shape):
        raise ShapeError(
            f"labels of shape {shapes.fmt(labels.shape)} must match logits "
            f"{shapes.fmt(logits.shape)} without its last (class) dim"
        )
    batch = shapes.merge(batch, labels.shape)
    classes = (None,) if logits.shape is None else logits.shape[-1:]
    full = None if batch is None else batch + classes
    return [(logits.dtype, batch), (logits.dtype, full)]


def softmax_cross_entropy_with_logits(labels, logits, axis=None, name=None) -> Tensor:
    """Per-row ``-sum(labels * log_softmax(logits))`` over the last axis.

    Each row of ``labels`` should be a probability distribution: like TensorFlow, the
    gradient w.r.t. ``logits`` is the kernel's ``softmax - labels``, which is exact only then.
    """
    _check_axis("softmax_cross_entropy_with_logits", axis)
    logits = convert_to_tensor(logits)
    labels = convert_to_tensor(labels, dtype=logits.dtype)
    return _out("SoftmaxCrossEntropyWithLogits", [logits, labels], name=name)


def sparse_softmax_cross_entropy_with_logits(labels, logits, name=None) -> Tensor:
    """Per-row ``-log_softmax(logits)[label]``, with ``labels`` integer class indices."""
    logits = convert_to_tensor(logits)
    labels = convert_to_tensor(labels)
    return _out("SparseSoftmaxCrossEntropyWithLogits", [logits, labels], name=name)


def _per_row(g: Tensor, like: Tensor) -> Tensor:
    """A per-row gradient broadcast along the class axis of ``like`` (a view, no copy)."""
    return broadcast_to_shape_of(g, like, axes=(-1,))


def _softmax_jvp_term(logits: Tensor, grad_grad: Tensor) -> Tensor | None:
    """The backprop output's own gradient (``d softmax / d logits`` applied to it), if any flows."""
    if grad_grad.op.type == "ZerosLike":  # filled in by ``gradients`` for an unused output
        return None
    return _softmax_vjp_of(softmax(logits), grad_grad)


def _softmax_vjp_of(y: Tensor, g: Tensor) -> Tensor:
    return (g - reduce_sum(g * y, axis=-1, keepdims=True)) * y


@defvjp("SoftmaxCrossEntropyWithLogits")
def _xent_vjp(op, grad_loss, grad_grad):
    logits, labels = op.inputs
    backprop = op.outputs[1]
    per_row = _per_row(grad_loss, backprop)
    d_logits = per_row * backprop
    d_labels = per_row * -log_softmax(logits)
    second = _softmax_jvp_term(logits, grad_grad)
    if second is not None:
        d_logits = d_logits + second
        d_labels = d_labels - grad_grad
    return [d_logits, d_labels]


@defvjp("SparseSoftmaxCrossEntropyWithLogits")
def _sparse_xent_vjp(op, grad_loss, grad_grad):
    logits = op.inputs[0]
    backprop = op.outputs[1]
    d_logits = _per_row(grad_loss, backprop) * backprop
    second = _softmax_jvp_term(logits, grad_grad)
    if second is not None:
        d_logits = d_logits + second
    return [d_logits, None]


# ---- L2 loss


@define_op("L2Loss", num_inputs=1)
def _l2_loss_shape(inputs, attrs):
    require_float(inputs[0])
    return [(inputs[0].dtype, ())]


def l2_loss(t, name=None) -> Tensor:
    """``sum(t ** 2) / 2``: the usual weight-decay penalty, as one reduction."""
    return _out("L2Loss", [convert_to_tensor(t)], name=name)


@defvjp("L2Loss")
def _l2_loss_vjp(op, g):
    return [g * op.inputs[0]]


# ---- dropout


def dropout(x, rate=None, noise_shape=None, seed=None, name=None, *, keep_prob=None) -> Tensor:
    """Zero each entry with probability ``rate`` and scale the rest by ``1 / (1 - rate)``,
    so the expected value is unchanged and inference needs no rescaling.

    TensorFlow 1.x's ``keep_prob=`` is accepted by name (``rate = 1 - keep_prob``). A
    ``rate`` that is a tensor is checked when the step runs: a keep probability of 1.0
    fed as the rate would scale by infinity.

    Entries of ``x`` along a dim where ``noise_shape`` is 1 are kept or dropped together.
    By default the noise has the shape of ``x``, read at run time where it is not static.
    """
    x = convert_to_tensor(x)
    if x.dtype.kind != "f":
        raise ValueError(f"dropout: x must be floating-point, got {x.dtype}")
    if (rate is None) == (keep_prob is None):
        raise ValueError("dropout: pass rate (or TensorFlow 1.x's keep_prob=), exactly one")
    if keep_prob is not None:
        if not isinstance(keep_prob, Tensor):
            keep_prob = float(keep_prob)
            if not 0.0 < keep_prob <= 1.0:
                raise ValueError(f"dropout: keep_prob must be in (0, 1], got {keep_prob}")
        rate = 1.0 - keep_prob
    if not isinstance(rate, Tensor):
        rate = float(rate)
        if not 0.0 <= rate < 1.0:
            raise ValueError(f"dropout: rate must be in [0, 1), got {rate}")
        if rate == 0.0:
            return x
    graph = x.graph
    with graph.as_default(), graph.name_scope(name or "dropout"):
        if isinstance(rate, Tensor):
            rate = cast(rate, x.dtype)
            message = ("dropout: rate must be in [0, 1) (TensorFlow 1.x's keep_prob is "
                       "1 - rate: pass it as keep_prob=)")
            checks = [assert_non_negative(rate, message=message),
                      assert_less(rate, 1.0, message=message)]
            with graph.control_dependencies(checks):
                rate = identity(rate)
        if isinstance(noise_shape, Tensor):
            noise = noise_shape
        elif noise_shape is not None:
            noise = shapes.as_shape(noise_shape)
            if None in noise:
                raise ValueError(
                    f"dropout: noise_shape {shapes.fmt(noise)} has unknown dims; pass a tensor"
                )
        elif x.shape is not None and None not in x.shape:
            noise = x.shape
        else:
            noise = shape_of(x)
        u = random_uniform(noise, dtype=x.dtype, seed=seed)
        keep = cast(greater_equal(u, rate), x.dtype)
        return x * (keep * (1.0 / (1.0 - rate)))


# ---- 2-D convolution


_CONV_ATTRS = {"strides": (1, 1, 1, 1), "padding": None, "dilations": (1, 1, 1, 1)}


def _conv_output_shape(x: Tensor, f: Tensor, attrs: dict, what: str) -> tuple:
    """Validate an NHWC input against an HWIO filter; the Conv2D output shape."""
    require_same_dtype([x, f])
    require_float(x)
    _rank_exactly(x, 4, f"{what} input")
    _rank_exactly(f, 4, f"{what} filter")
    dilations = _spatial(attrs, "dilations")
    xs = x.shape if x.shape is not None else (None,) * 4
    fs = f.shape if f.shape is not None else (None,) * 4
    _merge_dim(
        xs[3], fs[2],
        f"input {shapes.fmt(x.shape)} has {xs[3]} channels but filter "
        f"{shapes.fmt(f.shape)} expects {fs[2]} (filters are [height, width, in, out])",
    )
    oh, ow = _out_hw(xs, fs[:2], attrs, dilations)
    return (xs[0], oh, ow, fs[3])


@define_op("Conv2D", attrs=_CONV_ATTRS, num_inputs=2)
def _conv2d_shape(inputs, attrs):
    x, f = inputs
    return [(x.dtype, _conv_output_shape(x, f, attrs, "Conv2D"))]


@define_op("Conv2DBackpropInput", attrs=_CONV_ATTRS, num_inputs=3)
def _conv2d_backprop_input_shape(inputs, attrs):
    x_like, f, g = inputs
    want = _conv_output_shape(x_like, f, attrs, "Conv2DBackpropInput")
    require_same_dtype([f, g])
    _check_out_backprop(g, want, "Conv2DBackpropInput")
    return [(f.dtype, x_like.shape)]


@define_op("Conv2DBackpropFilter", attrs=_CONV_ATTRS, num_inputs=3)
def _conv2d_backprop_filter_shape(inputs, attrs):
    x, f_like, g = inputs
    want = _conv_output_shape(x, f_like, attrs, "Conv2DBackpropFilter")
    require_same_dtype([x, g])
    _check_out_backprop(g, want, "Conv2DBackpropFilter")
    return [(x.dtype, f_like.shape)]


def _nhwc(value, what: str) -> tuple[int, int, int, int]:
    """Normalize an int, (h, w) or (1, h, w, 1) to the 4-tuple the ops keep as attr."""
    if isinstance(value, int):
        return (1, value, value, 1)
    value = tuple(int(v) for v in value)
    if len(value) == 1:
        return (1, value[0], value[0], 1)
    if len(value) == 2:
        return (1, value[0], value[1], 1)
    if len(value) == 4:
        return value
    raise ValueError(f"{what} must be an int or a sequence of 1, 2 or 4 ints, got {value!r}")


def _conv_attrs(strides, padding, dilations, data_format) -> dict:
    if data_format not in (None, "NHWC"):
        raise ValueError(f"only NHWC data is supported, got data_format={data_format!r}")
    if not isinstance(padding, str):
        raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")
    return {
        "strides": _nhwc(strides, "strides"),
        "padding": padding.upper(),
        "dilations": _nhwc(1 if dilations is None else dilations, "dilations"),
    }


def conv2d(
    input, filters, strides, padding: str, data_format="NHWC", dilations=None, name=None
) -> Tensor:
    """2-D cross-correlation of NHWC ``input`` with HWIO ``filters``."""
    x = convert_to_tensor(input)
    f = convert_to_tensor(filters, dtype=x.dtype if not isinstance(filters, Tensor) else None)
    attrs = _conv_attrs(strides, padding, dilations, data_format)
    return _out("Conv2D", [x, f], attrs, name)


def conv2d_backprop_input(
    input_like: Tensor, filters: Tensor, out_backprop: Tensor, strides, padding: str,
    dilations=None, name=None,
) -> Tensor:
    """Gradient of Conv2D w.r.t. its input; ``input_like`` lends only its shape."""
    attrs = _conv_attrs(strides, padding, dilations, None)
    return _out("Conv2DBackpropInput", [input_like, filters, out_backprop], attrs, name)


def conv2d_backprop_filter(
    input: Tensor, filters_like: Tensor, out_backprop: Tensor, strides, padding: str,
    dilations=None, name=None,
) -> Tensor:
    """Gradient of Conv2D w.r.t. its filter; ``filters_like`` lends only its shape."""
    attrs = _conv_attrs(strides, padding, dilations, None)
    return _out("Conv2DBackpropFilter", [input, filters_like, out_backprop], attrs, name)


def _same_conv(op) -> dict:
    return {k: op.attrs[k] for k in _CONV_ATTRS}


@defvjp("Conv2D")
def _conv2d_vjp(op, g):
    x, f = op.inputs
    a = _same_conv(op)
    return [
        _out("Conv2DBackpropInput", [x, f, g], a),
        _out("Conv2DBackpropFilter", [x, f, g], a),
    ]


# Both backward ops are linear in each of their value inputs, with Conv2D and each other
# as adjoints: <h, dx(f, g)> = <conv(h, f), g> and <h, dw(x, g)> = <conv(x, h), g>.


@defvjp("Conv2DBackpropInput")
def _conv2d_backprop_input_vjp(op, h):
    _, f, g = op.inputs
    a = _same_conv(op)
    return [
        None,
        _out("Conv2DBackpropFilter", [h, f, g], a),
        _out("Conv2D", [h, f], a),
    ]


@defvjp("Conv2DBackpropFilter")
def _conv2d_backprop_filter_vjp(op, h):
    x, f, g = op.inputs
    a = _same_conv(op)
    return [
        _out("Conv2DBackpropInput", [x, h, g], a),
        None,
        _out("Conv2D", [x, h], a),
    ]


# ---- pooling


_POOL_ATTRS = {"ksize": (1, 1, 1, 1), "strides": (1, 1, 1, 1), "padding": None}


def _pool_output_shape(x: Tensor, attrs: dict, what: str) -> tuple:
    _rank_exactly(x, 4, f"{what} input")
    kh, kw = _spatial(attrs, "ksize")
    xs = x.shape if x.shape is not None else (None,) * 4
    oh, ow = _out_hw(xs, (kh, kw), attrs)
    return (xs[0], oh, ow, xs[3])


@define_op("MaxPool", attrs=_POOL_ATTRS, num_inputs=1)
def _max_pool_shape(inputs, attrs):
    (x,) = inputs
    if x.dtype.kind not in "fiu":
        raise ShapeError(f"MaxPool needs a real-valued input, got {x.dtype}")
    return [(x.dtype, _pool_output_shape(x, attrs, "MaxPool"))]


@define_op("AvgPool", attrs=_POOL_ATTRS, num_inputs=1)
def _avg_pool_shape(inputs, attrs):
    (x,) = inputs
    require_float(x)
    return [(x.dtype, _pool_output_shape(x, attrs, "AvgPool"))]


@define_op("MaxPoolGrad", attrs=_POOL_ATTRS, num_inputs=3)
def _max_pool_grad_shape(inputs, attrs):
    x, y, g = inputs
    dtype = require_same_dtype(inputs)
    want = _pool_output_shape(x, attrs, "MaxPoolGrad")
    for t, role in ((y, "orig_output"), (g, "grad")):
        _rank_exactly(t, 4, f"MaxPoolGrad {role}")
        if not shapes.compatible(t.shape, want):
            raise ShapeError(
                f"MaxPoolGrad {role} has shape {shapes.fmt(t.shape)}, pooling "
                f"{shapes.fmt(x.shape)} gives {shapes.fmt(want)}"
            )
    return [(dtype, x.shape)]


@define_op("MaxPoolGradGrad", attrs=_POOL_ATTRS, num_inputs=3)
def _max_pool_grad_grad_shape(inputs, attrs):
    x, y, h = inputs
    dtype = require_same_dtype(inputs)
    want = _pool_output_shape(x, attrs, "MaxPoolGradGrad")
    if not shapes.compatible(y.shape, want):
        raise ShapeError(
            f"MaxPoolGradGrad orig_output has shape {shapes.fmt(y.shape)}, pooling "
            f"{shapes.fmt(x.shape)} gives {shapes.fmt(want)}"
        )
    if not shapes.compatible(h.shape, x.shape):
        raise ShapeError(
            f"MaxPoolGradGrad grad has shape {shapes.fmt(h.shape)}, "
            f"unlike orig_input {shapes.fmt(x.shape)}"
        )
    return [(dtype, shapes.merge(y.shape, want))]


@define_op("AvgPoolGrad", attrs=_POOL_ATTRS, num_inputs=2)
def _avg_pool_grad_shape(inputs, attrs):
    x_like, g = inputs
    dtype = require_same_dtype(inputs)
    require_float(g)
    want = _pool_output_shape(x_like, attrs, "AvgPoolGrad")
    _check_out_backprop(g, want, "AvgPoolGrad")
    return [(dtype, x_like.shape)]


def _pool_attrs(ksize, strides, padding, data_format) -> dict:
    if data_format not in (None, "NHWC"):
        raise ValueError(f"only NHWC data is supported, got data_format={data_format!r}")
    if not isinstance(padding, str):
        raise ValueError(f"padding must be 'SAME' or 'VALID', got {padding!r}")
    return {
        "ksize": _nhwc(ksize, "ksize"),
        "strides": _nhwc(strides, "strides"),
        "padding": padding.upper(),
    }


def max_pool(input, ksize, strides, padding: str, data_format="NHWC", name=None) -> Tensor:
    """Max over each ``ksize`` window; SAME padding never wins (it counts as -infinity)."""
    attrs = _pool_attrs(ksize, strides, padding, data_format)
    return _out("MaxPool", [convert_to_tensor(input)], attrs, name)


def avg_pool(input, ksize, strides, padding: str, data_format="NHWC", name=None) -> Tensor:
    """Mean over each window; with SAME padding only real entries count, as in TensorFlow."""
    attrs = _pool_attrs(ksize, strides, padding, data_format)
    return _out("AvgPool", [convert_to_tensor(input)], attrs, name)


def max_pool_grad(
    orig_input, orig_output, grad, ksize, strides, padding: str, name=None
) -> Tensor:
    """Each window's gradient goes to its first maximum (row-major), as in TensorFlow on CPU."""
    attrs = _pool_attrs(ksize, strides, padding, None)
    inputs = [orig_input, orig_output, grad]
    return _out("MaxPoolGrad", inputs, attrs, name)


def max_pool_grad_grad(
    orig_input, orig_output, grad, ksize, strides, padding: str, name=None
) -> Tensor:
    """Picks, for each window, the entry of ``grad`` (input-shaped) at its first maximum."""
    attrs = _pool_attrs(ksize, strides, padding, None)
    inputs = [orig_input, orig_output, grad]
    return _out("MaxPoolGradGrad", inputs, attrs, name)


def avg_pool_grad(input_like, grad, ksize, strides, padding: str, name=None) -> Tensor:
    """Spreads each window's gradient evenly over its real entries."""
    attrs = _pool_attrs(ksize, strides, padding, None)
    return _out("AvgPoolGrad", [input_like, grad], attrs, name)


def _same_pool(op) -> dict:
    return {k: op.attrs[k] for k in _POOL_ATTRS}


@defvjp("MaxPool")
def _max_pool_vjp(op, g):
    x, y = op.inputs[0], op.outputs[0]
    return [_out("MaxPoolGrad", [x, y, g], _same_pool(op))]


# MaxPoolGrad and MaxPoolGradGrad route values along the argmax of each window: linear in
# the routed gradient, constant in the pooled values almost everywhere (None there).


@defvjp("MaxPoolGrad")
def _max_pool_grad_vjp(op, h):
    x, y, _ = op.inputs
    return [None, None, _out("MaxPoolGradGrad", [x, y, h], _same_pool(op))]


@defvjp("MaxPoolGradGrad")
def _max_pool_grad_grad_vjp(op, h):
    x, y, _ = op.inputs
    return [None, None, _out("MaxPoolGrad", [x, y, h], _same_pool(op))]


@defvjp("AvgPool")
def _avg_pool_vjp(op, g):
    return [_out("AvgPoolGrad", [op.inputs[0], g], _same_pool(op))]


@defvjp("AvgPoolGrad")
def _avg_pool_grad_vjp(op, h):
    # AvgPool and AvgPoolGrad are adjoint linear maps.
    return [None, _out("AvgPool", [h], _same_pool(op))]
