"""Gradients through while loops and conds (paper sections 3.4 and 4.1): the backward loop
runs the iterations in reverse, reading the forward values it needs off per-iteration
stacks. Every case is checked forward against NumPy and its gradient, with respect to
every float input (initial values and loop constants), against central differences."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels import KernelContext, get_builder
from flowmill.kernels.stack import StackEmptyError, StackFullError
from flowmill.runtime.backprop import to_dense
from flowmill.runtime.ops import nn_ops as nn
from flowmill.runtime.prune import prune

from opcheck import OpCase, case_tests

rng = np.random.default_rng(11)
T, B, D, H = 4, 2, 3, 3


def r(*shape, scale=0.5):
    return rng.normal(0.0, scale, size=shape)


def loop(cond, body, init, **kw):
    return fm.while_loop(cond, body, init, **kw)


# ---- the cases: loops of every shape the models here use


def rnn(seq, h0, wx, wh):
    def body(t, h):
        return t + 1, nn.tanh(fm.matmul(fm.gather(seq, t), wx) + fm.matmul(h, wh))

    return loop(lambda t, h: fm.less(t, T), body, [fm.constant(0), h0])[1]


def ref_rnn(seq, h0, wx, wh):
    h = h0
    for t in range(T):
        h = np.tanh(seq[t] @ wx + h @ wh)
    return h


def doubling(x, w):
    """Runs until the sum passes 10: the trip count depends on the data."""
    return loop(lambda v: fm.reduce_sum(v) < 10.0, lambda v: v * w, x)


def ref_doubling(x, w):
    while x.sum() < 10.0:
        x = x * w
    return x


def nested(x, w):
    def outer(i, h):
        inner = loop(
            lambda j, g: fm.less(j, i + 1), lambda j, g: (j + 1, nn.tanh(g * w) + x),
            [fm.constant(0), h],
        )[1]
        return i + 1, inner * 0.5

    return loop(lambda i, h: fm.less(i, 3), outer, [fm.constant(0), x])[1]


def ref_nested(x, w):
    h = x
    for i in range(3):
        for _ in range(i + 1):
            h = np.tanh(h * w) + x
        h = h * 0.5
    return h


def cond_in_loop(x, w):
    def body(t, h):
        h = fm.cond(fm.less(t, 2), lambda: h * w, lambda: nn.tanh(h) + x)
        return t + 1, h

    return loop(lambda t, h: fm.less(t, 4), body, [fm.constant(0), x])[1]


def ref_cond_in_loop(x, w):
    h = x
    for t in range(4):
        h = h * w if t < 2 else np.tanh(h) + x
    return h


def loop_in_cond(x, w):
    def taken():
        return loop(lambda t, h: fm.less(t, 3), lambda t, h: (t + 1, h * w), [fm.constant(0), x])[1]

    return [
        fm.cond(fm.reduce_sum(x) > 0.0, taken, lambda: x * 2.0),
        fm.cond(fm.reduce_sum(x) < 0.0, taken, lambda: x * 2.0),
    ]


def ref_loop_in_cond(x, w):
    taken = x * w * w * w
    return [taken if x.sum() > 0 else x * 2, taken if x.sum() < 0 else x * 2]


def bounded(x, w):
    """Would run forever; ``maximum_iterations`` stops it after 5."""
    return loop(lambda v: fm.reduce_sum(v) > -1e9, lambda v: nn.tanh(v * w), x,
                maximum_iterations=5, swap_memory=True)


def ref_bounded(x, w):
    for _ in range(5):
        x = np.tanh(x * w)
    return x


def swapping(a, b, w):
    """Loop variables that swap places and one that passes through unchanged."""
    def body(t, a, b, c):
        return t + 1, b, a * w, c

    out = loop(lambda t, *_: fm.less(t, 3), body, [fm.constant(0), a, b, a * 3.0])
    return out[1] + out[2] * 2.0 + out[3]


def ref_swapping(a, b, w):
    c = a * 3.0
    for _ in range(3):
        a, b = b, a * w
    return a + b * 2.0 + c


def no_iterations(x, w):
    return loop(lambda t, h: fm.less(t, 0), lambda t, h: (t + 1, h * w), [fm.constant(0), x])[1] + w


def lookup(table, h0):
    """Rows of a loop constant gathered in the body: a sparse gradient, summed over steps."""
    ids = fm.constant(np.array([[0, 2], [1, 1], [3, 0]], np.int32))

    def body(t, h):
        return t + 1, nn.tanh(h + fm.gather(table, fm.gather(ids, t)))

    return loop(lambda t, h: fm.less(t, 3), body, [fm.constant(0), h0])[1]


def ref_lookup(table, h0):
    ids = [[0, 2], [1, 1], [3, 0]]
    h = h0
    for t in range(3):
        h = np.tanh(h + table[ids[t]])
    return h


def lstm(seq, wx, wh):
    """The LSTM cell over a sequence, as dynamic_rnn runs it."""
    def body(t, c, h):
        gates = fm.matmul(fm.gather(seq, t), wx) + fm.matmul(h, wh)
        i, f, g, o = fm.split(gates, 4, axis=1)
        c = nn.sigmoid(f) * c + nn.sigmoid(i) * nn.tanh(g)
        return t + 1, c, nn.sigmoid(o) * nn.tanh(c)

    zeros = fm.zeros([B, H], seq.dtype)
    _, c, h = loop(lambda t, c, h: fm.less(t, T), body, [fm.constant(0), zeros, zeros])
    return [c, h]


def ref_lstm(seq, wx, wh):
    def sig(v):
        return 1 / (1 + np.exp(-v))

    c = h = np.zeros((B, H))
    for t in range(T):
        i, f, g, o = np.split(seq[t] @ wx + h @ wh, 4, axis=1)
        c = sig(f) * c + sig(i) * np.tanh(g)
        h = sig(o) * np.tanh(c)
    return [c, h]


def matmul_trips(h0, w, v):
    """A weight multiplied in the body (its gradient is one matmul after the loop), for a
    loop that may run no iteration, and a weight whose product never reaches the output."""
    def body(t, h):
        unused = fm.matmul(h, v)  # noqa: F841  (no gradient reaches v through it)
        return t + 1, nn.tanh(fm.matmul(h, w))

    n = fm.cast(fm.reduce_sum(h0) > 0.0, fm.int32) * 3  # 3 iterations or none
    return loop(lambda t, h: fm.less(t, n), body, [fm.constant(0), h0])[1] + fm.reduce_sum(v)


def ref_matmul_trips(h0, w, v):
    h = h0
    for _ in range(3 if h0.sum() > 0 else 0):
        h = np.tanh(h @ w)
    return h + v.sum()


def nested_matmul(x, w, u):
    """Weights multiplied in an inner loop and in the outer body: the factor arrays of the
    inner loop's gradient are made once per outer iteration, sized by its own count."""
    def outer(i, h):
        inner = loop(
            lambda j, g: fm.less(j, i + 1), lambda j, g: (j + 1, nn.tanh(fm.matmul(g, w))),
            [fm.constant(0), h],
        )[1]
        return i + 1, nn.tanh(fm.matmul(inner, u)) + x

    return loop(lambda i, h: fm.less(i, 3), outer, [fm.constant(0), x])[1]


def ref_nested_matmul(x, w, u):
    h = x
    for i in range(3):
        g = h
        for _ in range(i + 1):
            g = np.tanh(g @ w)
        h = np.tanh(g @ u) + x
    return h


def cube_grad(x):
    """A loop's gradient as an op's output: forward-checks the stack ops."""
    y = loop(lambda t, y: fm.less(t, 3), lambda t, y: (t + 1, y * x),
             [fm.constant(0), fm.ones_like(x)])[1]
    return fm.gradients(fm.reduce_sum(y), [x])[0]


CASES = [
    OpCase("while_rnn", rnn, [r(T, B, D), r(B, H), r(D, H), r(H, H)], ref_rnn),
    OpCase("while_data_dependent_trips", doubling,
           [np.array([0.5, 0.7, 0.9]), np.array([1.5, 1.9, 1.7])], ref_doubling),
    OpCase("while_nested", nested, [r(2, 3), r(2, 3)], ref_nested),
    OpCase("while_cond_inside", cond_in_loop, [r(2, 3), r(2, 3)], ref_cond_in_loop),
    OpCase("while_in_cond", loop_in_cond, [np.abs(r(2, 3)) + 0.1, r(2, 3)], ref_loop_in_cond),
    OpCase("while_in_cond_other_branch", loop_in_cond, [-np.abs(r(2, 3)) - 0.1, r(2, 3)],
           ref_loop_in_cond),
    OpCase("while_maximum_iterations", bounded, [r(2, 3), r(2, 3)], ref_bounded),
    OpCase("while_swapped_vars", swapping, [r(2, 2), r(2, 2), r(2, 2)], ref_swapping),
    OpCase("while_zero_iterations", no_iterations, [r(2), r(2)], lambda x, w: x + w),
    OpCase("while_gather_constant", lookup, [r(4, 3), r(2, 3)], ref_lookup),
    OpCase("while_lstm", lstm, [r(T, B, D), r(D, 4 * H), r(H, 4 * H)], ref_lstm),
    OpCase("while_matmul_weight", matmul_trips, [np.abs(r(2, 3)), r(3, 3), r(3, 2)],
           ref_matmul_trips),
    OpCase("while_matmul_weight_no_iterations", matmul_trips, [-np.abs(r(2, 3)), r(3, 3),
                                                               r(3, 2)], ref_matmul_trips),
    OpCase("while_nested_matmul_weights", nested_matmul, [r(2, 3), r(3, 3), r(3, 3)],
           ref_nested_matmul),
    OpCase("while_gradient_stacks", cube_grad, [np.array([0.5, -1.5, 2.0], np.float32)],
           lambda x: 3 * x * x, grad=False),
]

test_forward, test_gradient = case_tests(CASES)


# ---- the model a TensorFlow 1.x user writes


def test_every_weight_of_a_loop_gets_its_gradient_and_minimize_trains_them_all():
    g = fm.Graph(seed=3)
    with g.as_default():
        seq = fm.placeholder(fm.float32, [T, None, D])
        target = fm.placeholder(fm.float32, [None, 1])
        wx = fm.Variable(r(D, H).astype(np.float32), name="Wx")
        wh = fm.Variable(r(H, H).astype(np.float32), name="Wh")
        b = fm.Variable(np.zeros(H, np.float32), name="b")
        wo = fm.Variable(r(H, 1).astype(np.float32), name="Wo")
        h0 = fm.zeros_like(fm.matmul(fm.gather(seq, 0), fm.zeros([D, H])))

        def body(t, h):
            return t + 1, nn.tanh(fm.matmul(fm.gather(seq, t), wx) + fm.matmul(h, wh) + b)

        _, h = fm.while_loop(lambda t, h: fm.less(t, T), body, [fm.constant(0), h0])
        loss = fm.reduce_mean(fm.square(fm.matmul(h, wo) - target))
        grads = fm.gradients(loss, [wx, wh, b, wo])
        assert all(gr is not None for gr in grads)
        train = fm.train.GradientDescent(0.5).minimize(loss)
    feed = {seq: r(T, 8, D).astype(np.float32), target: r(8, 1).astype(np.float32)}
    with fm.Session(g) as sess:
        sess.run(fm.global_variables_initializer())
        before = sess.run([wx, wh, b, wo])
        first = sess.run(loss, feed)
        for _ in range(30):
            sess.run(train, feed)
        after = sess.run([wx, wh, b, wo])
        assert sess.run(loss, feed) < 0.5 * first
    for v0, v1 in zip(before, after, strict=True):
        assert not np.allclose(v0, v1)


def test_gradient_with_respect_to_a_tensor_inside_a_loop_is_refused_by_name():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float32, [2])
        inside = []

        def body(t, h):
            y = h * 2.0
            inside.append(y)
            return t + 1, y

        _, out = fm.while_loop(lambda t, h: fm.less(t, 2), body, [fm.constant(0), x])
        with pytest.raises(ValueError, match=r"inside while loop 'while'"):
            fm.gradients(out, [inside[0]])


def test_a_step_fetching_only_the_forward_loop_pushes_nothing():
    """The pushes run only in steps that run the gradient: a forward-only step (evaluation)
    does not fill stacks it never pops."""
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float64, [3])
        y = loop(lambda t, y: fm.less(t, 3), lambda t, y: (t + 1, y * x),
                 [fm.constant(0), fm.ones_like(x)])[1]
        (gx,) = fm.gradients(fm.reduce_sum(y), [x])
    with fm.Session(g) as sess:
        v = np.array([1.0, 2.0, 3.0])
        forward = sess.run(y, {x: v})
        np.testing.assert_allclose(forward, v**3)
        plan = next(iter(sess._plans.values())).plan
        assert "StackPushV2" not in {n.type for n in plan.order}
        np.testing.assert_allclose(sess.run(gx, {x: v}), 3 * v**2)


def test_gradient_loop_is_the_forward_loop_run_backwards():
    """Each stacked value is popped by the iteration that mirrors its push: with a body
    y = y * x_t over a sequence, d/dx_t is the product of the other factors."""
    g = fm.Graph()
    with g.as_default():
        xs = fm.placeholder(fm.float64, [5])
        y = loop(lambda t, y: fm.less(t, 5), lambda t, y: (t + 1, y * fm.gather(xs, t)),
                 [fm.constant(0), fm.constant(1.0, fm.float64)])[1]
        (gx,) = fm.gradients(y, [xs])
        gx = to_dense(gx)  # a gather's gradient: sparse rows
    v = np.array([2.0, 3.0, 5.0, 7.0, 11.0])
    with fm.Session(g) as sess:
        np.testing.assert_allclose(sess.run(gx, {xs: v}), np.prod(v) / v)


def _stack_kernel(op_type: str, **attrs):
    ctx = KernelContext(op_type=op_type, name=op_type, attrs=attrs, device_type="CPU",
                        resources=None)
    return get_builder(op_type, "CPU")(ctx)


def test_stacks_are_bounded_and_say_which_stack_overflowed():
    stack = _stack_kernel("StackV2", elem_type=np.float32, max_size=2, stack_name="while/h:0")()
    push = _stack_kernel("StackPushV2", swap_memory=False)
    pop = _stack_kernel("StackPopV2", elem_type=np.float32, elem_shape=(), swap_memory=False,
                        may_be_dead=False)
    push(stack, np.float32(1))
    push(stack, np.float32(2))
    with pytest.raises(StackFullError, match=r"'while/h:0' is full: 2 values"):
        push(stack, np.float32(3))
    assert pop(stack) == 2 and pop(stack) == 1
    with pytest.raises(StackEmptyError, match="'while/h:0' is empty"):
        pop(stack)


def test_maximum_iterations_bounds_the_gradient_stacks():
    g = fm.Graph()
    with g.as_default():
        x = fm.placeholder(fm.float64, [2])
        y = bounded(x, fm.constant(np.array([0.5, 1.5])))
        fm.gradients(fm.reduce_sum(y), [x])
    stacks = [op for op in g.get_operations() if op.type == "StackV2"]
    assert stacks and all(op.attrs["max_size"] == 5 for op in stacks)
    pushes = [op for op in g.get_operations() if op.type == "StackPushV2"]
    assert pushes and all(op.attrs["swap_memory"] for op in pushes)


def test_a_loop_weight_gradient_is_one_matmul_after_the_loop():
    """x_t @ W in the body: W's gradient sums x_t^T g_t over the steps as one matmul of the
    stacked factors, not as a matmul and a weight-sized add in every iteration."""
    g = fm.Graph()
    with g.as_default():
        h0 = fm.placeholder(fm.float64, [2, 3])
        w = fm.placeholder(fm.float64, [3, 3])
        v = fm.placeholder(fm.float64, [3, 2])
        out = matmul_trips(h0, w, v)
        gw, gv = fm.gradients(fm.reduce_sum(out), [w, v])
    assert gw.op.type == "MatMul" and gw.op.cf_context is None
    assert {op.name.rsplit("/", 1)[-1] for op in g.get_operations()
            if op.type == "TensorArrayV3"} >= {"weight_inputs", "weight_grads"}
    step = prune([gw], [], [h0, w, v])
    in_loop = [n.name for n in step.nodes
               if n.type == "MatMul" and n.frames and n.shapes[0] == (3, 3)]
    assert not in_loop
