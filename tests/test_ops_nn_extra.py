"""Op cases for the TF1 additions to ``fm.nn``: LeakyReLU, ELU, moments, sigmoid
cross-entropy, top_k / in_top_k, the log-uniform candidate sampler, embedding_lookup over
shards and sampled softmax; each against a NumPy reference written from the definition,
the differentiable ones against central differences too."""

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.ops import activation_ops as act

from opcheck import OpCase, case_tests

rng = np.random.default_rng(11)
nn = fm.nn


def r(*shape, low=-2.0, high=2.0):
    return rng.uniform(low, high, size=shape).astype(np.float32)


def off_zero(*shape, scale=1.0):
    """Values at least 0.1 * scale away from 0: no finite difference straddles a kink."""
    x = r(*shape, low=0.1, high=2.0) * scale
    return (x * rng.choice([-1.0, 1.0], size=shape)).astype(np.float32)


def distinct(*shape):
    """Distinct values 0.1 apart, shuffled: no ties for top_k's gradient."""
    n = int(np.prod(shape))
    return (rng.permutation(n).reshape(shape) * 0.1 - n * 0.05).astype(np.float32)


def grad_of(y_fn):
    """d<y_fn(x), g>/dx: puts the forward op's gradient op in the case's graph."""
    return lambda x, g: fm.gradients(y_fn(x), x, grad_ys=g)[0]


# ---- NumPy references


def ref_elu(x):
    x = x.astype(np.float64)
    return np.where(x > 0, x, np.expm1(np.minimum(x, 0)))


def ref_sigmoid_xent(z, x):
    x, z = x.astype(np.float64), z.astype(np.float64)
    s = 1 / (1 + np.exp(-x))
    return -z * np.log(s) - (1 - z) * np.log(1 - s)


def ref_top_k(x, k):
    """By hand: repeatedly take the first (lowest-index) maximum of each row."""
    rows = x.reshape(-1, x.shape[-1])
    values, indices = [], []
    for row in rows:
        left = list(enumerate(row))
        vs, ix = [], []
        for _ in range(k):
            best = max(left, key=lambda p: (p[1], -p[0]))
            left.remove(best)
            ix.append(best[0])
            vs.append(best[1])
        values.append(vs)
        indices.append(ix)
    shape = x.shape[:-1] + (k,)
    return [np.array(values, x.dtype).reshape(shape), np.array(indices, np.int32).reshape(shape)]


def ref_in_top_k(pred, targets, k):
    out = []
    for row, t in zip(pred, targets, strict=True):
        if not 0 <= t < len(row) or not np.all(np.isfinite(row)):
            out.append(False)
            continue
        out.append(int(np.sum(row > row[t])) < k)
    return np.array(out)


def ref_log_uniform(true, num_sampled, unique, range_max, seed):
    """The one-at-a-time sampler of TensorFlow's range_sampler.cc, over the stream the op
    draws from (graph seed 7 in the case graphs, op seed ``seed``)."""
    stream = np.random.default_rng([7, seed])
    log_range = np.log1p(range_max)
    draws = (np.exp(stream.random(200_000) * log_range).astype(np.int64) - 1) % range_max
    if unique:
        picked, seen = [], set()
        for i, v in enumerate(draws):
            if v not in seen:
                seen.add(v)
                picked.append(v)
                if len(picked) == num_sampled:
                    tries = i + 1
                    break
    else:
        picked, tries = list(draws[:num_sampled]), num_sampled

    def count(c):
        p = np.log((c + 2.0) / (c + 1.0)) / log_range
        if tries == num_sampled:
            return (p * num_sampled).astype(np.float32)
        return (-np.expm1(tries * np.log1p(-p))).astype(np.float32)

    picked = np.array(picked, np.int64)
    return [picked, count(true.astype(np.float64)), count(picked.astype(np.float64))]


def ref_log_softmax(x):
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def ref_sampled_softmax(w, b, labels, x, sampled, true_exp, sampled_exp, remove_hits=True):
    w, b, x = (a.astype(np.float64) for a in (w, b, x))
    num_true = labels.shape[1]
    true_logits = (x[:, None, :] * w[labels]).sum(-1) + b[labels] - np.log(true_exp)
    sampled_logits = x @ w[sampled].T + b[sampled] - np.log(sampled_exp)
    if remove_hits:
        for i in range(len(labels)):
            for j, s in enumerate(sampled):
                if s in labels[i]:
                    sampled_logits[i, j] += -np.finfo(np.float32).max
    logits = np.concatenate([true_logits, sampled_logits], 1)
    targets = np.concatenate([np.full_like(true_logits, 1.0 / num_true),
                              np.zeros_like(sampled_logits)], 1)
    return -(targets * ref_log_softmax(logits)).sum(-1)


# ---- fixed inputs for the sparse cases

V, D, B = 10, 3, 4
W = r(V, D)
BIAS = r(V)
X = r(B, D)
LABELS_1 = np.array([[3], [0], [7], [3]], np.int64)
LABELS_2 = np.array([[3, 1], [0, 9], [7, 2], [3, 4]], np.int64)
# Fixed sampled values: class 0 and 3 are true classes of some examples (accidental hits).
SAMPLED = np.array([5, 0, 3, 8, 6], np.int64)
TRUE_EXP_1 = rng.uniform(0.2, 1.0, size=(B, 1)).astype(np.float32)
TRUE_EXP_2 = rng.uniform(0.2, 1.0, size=(B, 2)).astype(np.float32)
SAMPLED_EXP = rng.uniform(0.2, 1.0, size=5).astype(np.float32)
SHARDS = 3


def mod_shards(table, n=SHARDS):
    return [table[p::n] for p in range(n)]


def sampled_case(id, labels, true_exp, remove_hits=True, shards=False):
    values = (SAMPLED, true_exp, SAMPLED_EXP)
    num_true = labels.shape[1]

    def build(w, b, lb, x, *more):
        weights = [w, *more] if shards else w
        return nn.sampled_softmax_loss(
            weights, b, lb, x, num_sampled=len(SAMPLED), num_classes=V, num_true=num_true,
            sampled_values=values, remove_accidental_hits=remove_hits,
        )

    if shards:
        parts = mod_shards(W)
        inputs = [parts[0], BIAS, labels, X, *parts[1:]]

        def reference(w0, b, lb, x, *rest):
            table = np.empty((V, D), np.float64)
            for p, part in enumerate([w0, *rest]):
                table[p::SHARDS] = part
            return ref_sampled_softmax(table, b, lb, x, *values, remove_hits)
    else:
        inputs = [W, BIAS, labels, X]

        def reference(w, b, lb, x):
            return ref_sampled_softmax(w, b, lb, x, *values, remove_hits)

    return OpCase(id, build, inputs, reference, rtol=1e-5, atol=1e-6)


def lookup_case(id, strategy, ids):
    table = r(8, 2)
    if strategy == "mod":
        parts = mod_shards(table)
    else:  # 8 rows in 3 shards: 3, 3, 2
        parts = [table[0:3], table[3:6], table[6:8]]

    def reference(i, *ps):
        if strategy == "mod":
            full = np.empty((8, 2), ps[0].dtype)
            for p, part in enumerate(ps):
                full[p::SHARDS] = part
        else:
            full = np.concatenate(ps)
        return full[i]

    return OpCase(
        id,
        lambda i, *ps: nn.embedding_lookup(list(ps), i, partition_strategy=strategy),
        [ids, *parts],
        reference,
        wrt=[1, 2, 3],
    )


TIES = np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, -1.0, 0.0, 0.0, 5.0]], np.float32)
IN_TOP = np.array(
    [[0.1, 0.5, 0.5, 0.3], [0.9, 0.2, 0.1, 0.0], [1.0, np.inf, 0.0, 0.0], [0.4, 0.3, 0.2, 0.1]],
    np.float32,
)


CASES = [
    # activations
    OpCase("leaky_relu", nn.leaky_relu, [off_zero(3, 4)], lambda x: np.where(x > 0, x, 0.2 * x)),
    OpCase("leaky_relu_alpha", lambda x: nn.leaky_relu(x, alpha=0.01), [off_zero(2, 3)],
           lambda x: np.where(x > 0, x, 0.01 * x)),
    OpCase("leaky_relu_grad_of_leaky_relu", grad_of(nn.leaky_relu), [off_zero(3, 4), r(3, 4)],
           lambda x, g: np.where(x > 0, g, 0.2 * g), wrt=[1]),
    OpCase("leaky_relu_grad", lambda g, x: act.leaky_relu_grad(g, x, 0.3),
           [r(2, 5), off_zero(2, 5)], lambda g, x: np.where(x > 0, g, 0.3 * g), wrt=[0]),
    OpCase("elu", nn.elu, [off_zero(3, 4)], ref_elu),
    OpCase("elu_grad_of_elu", grad_of(nn.elu), [off_zero(3, 4), r(3, 4)],
           lambda x, g: np.where(x > 0, g, g * np.exp(x))),
    OpCase("elu_grad", act.elu_grad, [r(2, 5), off_zero(2, 5, scale=0.45)],
           lambda g, y: np.where(y < 0, g * (y + 1), g)),
    # moments and the logistic loss
    OpCase("moments_batch", lambda x: list(nn.moments(x, [0])), [r(5, 3)],
           lambda x: [x.mean(0), x.var(0)], rtol=1e-5, atol=1e-6),
    OpCase("moments_nhwc_keep_dims", lambda x: list(nn.moments(x, [0, 1, 2], keep_dims=True)),
           [r(2, 3, 2, 2)], lambda x: [x.mean((0, 1, 2), keepdims=True),
                                       x.var((0, 1, 2), keepdims=True)], atol=1e-6),
    OpCase(
        "sigmoid_cross_entropy",
        lambda z, x: nn.sigmoid_cross_entropy_with_logits(labels=z, logits=x),
        [r(3, 4, low=0.0, high=1.0), off_zero(3, 4, scale=3.0)],
        ref_sigmoid_xent,
    ),
    OpCase(
        "sigmoid_cross_entropy_large_logits",
        lambda z, x: nn.sigmoid_cross_entropy_with_logits(labels=z, logits=x),
        [np.array([1.0, 0.0, 1.0, 0.0], np.float32),
         np.array([40.0, -40.0, -90.0, 90.0], np.float32)],
        lambda z, x: np.array([np.exp(-40.0), np.exp(-40.0), 90.0, 90.0]),
        grad=False, rtol=1e-5, atol=0,
    ),
    # top k
    OpCase("top_k", lambda x: list(nn.top_k(x, 3)), [distinct(3, 6)],
           lambda x: ref_top_k(x, 3)),
    OpCase("top_k_3d", lambda x: list(nn.top_k(x, 2)), [distinct(2, 2, 4)],
           lambda x: ref_top_k(x, 2)),
    OpCase("top_k_ties_lower_index_first", lambda x: list(nn.top_k(x, 4)), [TIES],
           lambda x: ref_top_k(x, 4), grad=False),
    OpCase("top_k_zero", lambda x: list(nn.top_k(x, 0)), [distinct(2, 3)],
           lambda x: ref_top_k(x, 0), grad=False),
    OpCase(
        "in_top_k",
        lambda p, t: nn.in_top_k(p, t, 1),
        [IN_TOP, np.array([1, 0, 0, 7], np.int32)],
        lambda p, t: ref_in_top_k(p, t, 1),
        grad=False,
    ),
    OpCase(
        "in_top_k_2_ties_count",
        lambda p, t: nn.in_top_k(p, t, 2),
        [IN_TOP, np.array([2, 1, 1, 1], np.int64)],
        lambda p, t: ref_in_top_k(p, t, 2),
        grad=False,
    ),
    # candidate sampling
    OpCase(
        "log_uniform_unique",
        lambda t: list(nn.log_uniform_candidate_sampler(t, 2, 20, True, 30, seed=4)),
        [LABELS_2],
        lambda t: ref_log_uniform(t, 20, True, 30, 4),
        grad=False,
    ),
    OpCase(
        "log_uniform_with_repeats",
        lambda t: list(nn.log_uniform_candidate_sampler(t, 1, 8, False, 1000, seed=2)),
        [LABELS_1],
        lambda t: ref_log_uniform(t, 8, False, 1000, 2),
        grad=False,
    ),
    # embedding lookup over shards
    lookup_case("embedding_lookup_mod", "mod", np.array([[7, 1, 0], [4, 4, 2]], np.int32)),
    lookup_case("embedding_lookup_div", "div", np.array([7, 1, 0, 4, 4, 2, 6, 3], np.int64)),
    OpCase("embedding_lookup_one_table", lambda t, i: nn.embedding_lookup(t, i),
           [r(5, 2), np.array([[4, 0], [0, 2]], np.int32)], lambda t, i: t[i]),
    # sampled softmax with fixed sampled values (one sampled class hits a true class)
    sampled_case("sampled_softmax", LABELS_1, TRUE_EXP_1),
    sampled_case("sampled_softmax_keep_hits", LABELS_1, TRUE_EXP_1, remove_hits=False),
    sampled_case("sampled_softmax_num_true_2", LABELS_2, TRUE_EXP_2),
    sampled_case("sampled_softmax_sharded_weights", LABELS_1, TRUE_EXP_1, shards=True),
]


test_forward, test_gradient = case_tests(CASES)


# ---- what a wrong call is told


def _raises(exc, match, fn):
    with fm.Graph().as_default():
        with pytest.raises(exc, match=match):
            fn()


def test_bad_inputs_name_the_op_argument_and_shape():
    f = fm.placeholder
    _raises(fm.GraphError, r"\(TopK\).*fewer than k=4",
            lambda: nn.top_k(f(fm.float32, (2, 3)), 4))
    _raises(ValueError, "top_k: k must be a non-negative Python int",
            lambda: nn.top_k(f(fm.float32, (2, 3)), -1))
    _raises(fm.GraphError, r"\(InTopK\).*targets \(3,\) and predictions \(2, 4\) disagree",
            lambda: nn.in_top_k(f(fm.float32, (2, 4)), f(fm.int32, (3,)), 1))
    _raises(fm.GraphError, r"\(LeakyRelu\).*expected a floating-point input",
            lambda: nn.leaky_relu(f(fm.int32, (2,))))
    _raises(fm.GraphError, "labels \\(2, 3\\) and logits \\(2, 4\\) must have the same shape",
            lambda: nn.sigmoid_cross_entropy_with_logits(
                labels=f(fm.float32, (2, 3)), logits=f(fm.float32, (2, 4))))
    _raises(fm.GraphError, "moments of .*axis 2 out of range for rank 2",
            lambda: nn.moments(f(fm.float32, (2, 3)), [2]))
    _raises(TypeError, "embedding ids must be integers",
            lambda: nn.embedding_lookup([f(fm.float32, (3, 2))] * 2, f(fm.float32, (4,))))


def test_top_k_gradient_with_an_unknown_batch_and_the_kernel_check():
    with fm.Graph().as_default():
        x = fm.placeholder(fm.float32, (None, 5))
        values, _ = nn.top_k(x, 2)
        (dx,) = fm.gradients(fm.reduce_sum(values * [1.0, 10.0]), [x])
        xv = np.array([[0.0, 3.0, 1.0, 4.0, 2.0], [9.0, 8.0, 7.0, 6.0, 5.0]], np.float32)
        with fm.Session() as sess:
            np.testing.assert_array_equal(
                sess.run(dx, {x: xv}), [[0, 10, 0, 1, 0], [1, 10, 0, 0, 0]]
            )
        y = fm.placeholder(fm.float32, (None, None))
        short, _ = nn.top_k(y, 3)
        with fm.Session() as sess, pytest.raises(Exception, match="fewer than k=3"):
            sess.run(short, {y: np.zeros((2, 2), np.float32)})


def test_fm_nn_gives_every_function_of_nn_ops():
    """``fm.nn`` is a namespace over several modules; none of nn_ops' functions is lost."""
    import inspect

    from flowmill.runtime.ops import nn_ops

    public = {
        name for name, value in vars(nn_ops).items()
        if inspect.isfunction(value) and value.__module__ == nn_ops.__name__
        and not name.startswith("_")
    }
    assert public - set(nn.__all__) == set()
    assert all(getattr(nn, name) is getattr(nn_ops, name) for name in public)
