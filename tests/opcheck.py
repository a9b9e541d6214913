"""Op test cases: every op is checked forward against a NumPy reference and, when
differentiable, its gradient against central differences (like HIPS autograd's check_grads).

A test module named ``test_ops_*.py`` lists ``CASES``; ``test_op_coverage.py`` reads the
graphs they build and fails when some registered op is never checked.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.runtime.autodiff import IndexedSlices
from flowmill.runtime.backprop import to_dense


@dataclass
class OpCase:
    id: str
    build: Callable[..., object]  # placeholders -> tensor (or list of tensors)
    inputs: Sequence[np.ndarray]
    reference: Callable[..., object]  # numpy arrays -> array (or list of arrays)
    grad: bool = True  # check gradients w.r.t. the floating inputs
    wrt: Sequence[int] | None = None  # which inputs to differentiate (default: floating ones)
    rtol: float = 1e-5
    atol: float = 1e-6
    grad_tol: float = 1e-4
    op_types: set[str] = field(default_factory=set)  # filled by build_case

    def __repr__(self) -> str:
        return self.id


def _outputs(result) -> list:
    if isinstance(result, (list, tuple)):
        return list(result)
    return [result]


def build_case(case: OpCase, dtype_override=None, device: str | None = None):
    """Build the case's graph (its ops asking for ``device``, if given): returns (graph,
    placeholders, outputs)."""
    graph = fm.Graph(seed=7)
    with graph.as_default(), fm.device(device or ""):
        feeds = []
        for i, value in enumerate(case.inputs):
            value = np.asarray(value)
            dtype = value.dtype
            if dtype_override is not None and dtype.kind == "f":
                dtype = dtype_override
            feeds.append(fm.placeholder(dtype, value.shape, name=f"in{i}"))
        outputs = _outputs(case.build(*feeds))
    case.op_types |= {op.type for op in graph.get_operations()} - {"Placeholder"}
    return graph, feeds, outputs


def _run(graph, fetches, feeds, values):
    with fm.Session(graph) as sess:
        variables = fm.global_variables(graph)
        if variables:
            sess.run(fm.variables_initializer(variables))
        return sess.run(fetches, dict(zip(feeds, values, strict=True)))


def check_forward(case: OpCase, device: str | None = None) -> None:
    graph, feeds, outputs = build_case(case, device=device)
    got = _run(graph, outputs, feeds, [np.asarray(v) for v in case.inputs])
    want = _outputs(case.reference(*[np.asarray(v) for v in case.inputs]))
    assert len(got) == len(want), f"{case.id}: {len(got)} outputs, reference has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        w = np.asarray(w)
        assert np.shape(g) == w.shape, f"{case.id} output {i}: shape {np.shape(g)} != {w.shape}"
        if w.dtype.kind in "fc":
            np.testing.assert_allclose(g, w, rtol=case.rtol, atol=case.atol, err_msg=case.id)
        else:
            np.testing.assert_array_equal(g, w, err_msg=case.id)
        assert outputs[i].shape is None or all(
            d is None or d == s for d, s in zip(outputs[i].shape, np.shape(g), strict=True)
        ), f"{case.id}: static shape {outputs[i].shape} disagrees with result {np.shape(g)}"


def check_grads(case: OpCase, eps: float = 1e-6, device: str | None = None) -> None:
    """Compare ``gradients`` with central differences, in float64, on a random projection."""
    values = [
        np.asarray(v, np.float64) if np.asarray(v).dtype.kind == "f" else np.asarray(v)
        for v in case.inputs
    ]
    wrt = (
        case.wrt
        if case.wrt is not None
        else [i for i, v in enumerate(values) if v.dtype.kind == "f"]
    )
    graph, feeds, outputs = build_case(case, dtype_override=np.float64, device=device)
    rng = np.random.default_rng(0)
    with graph.as_default(), fm.device(device or ""):
        float_outs = [y for y in outputs if y.dtype.kind == "f"]
        projections = [fm.constant(rng.normal(size=_static(y))) for y in float_outs]
        loss = fm.add_n(
            [fm.reduce_sum(y * p) for y, p in zip(float_outs, projections, strict=True)]
        )
        grads = fm.gradients(loss, [feeds[i] for i in wrt])
        grads = [to_dense(g) if isinstance(g, IndexedSlices) else g for g in grads]
    missing = [feeds[i].name for i, g in zip(wrt, grads, strict=True) if g is None]
    assert not missing, f"{case.id}: no gradient reaches {missing}"
    with fm.Session(graph) as sess:
        variables = fm.global_variables(graph)
        if variables:
            sess.run(fm.variables_initializer(variables))
        analytic = sess.run(grads, dict(zip(feeds, values, strict=True)))
        for k, i in enumerate(wrt):
            numeric = np.zeros_like(values[i])
            flat = values[i].reshape(-1)
            for j in range(flat.size):
                old = flat[j]
                flat[j] = old + eps
                up = sess.run(loss, dict(zip(feeds, values, strict=True)))
                flat[j] = old - eps
                down = sess.run(loss, dict(zip(feeds, values, strict=True)))
                flat[j] = old
                numeric.reshape(-1)[j] = (up - down) / (2 * eps)
            np.testing.assert_allclose(
                analytic[k],
                numeric,
                rtol=case.grad_tol,
                atol=case.grad_tol,
                err_msg=f"{case.id}: gradient w.r.t. input {i}",
            )


def _static(y) -> tuple:
    assert y.shape is not None and None not in y.shape, f"{y.name} needs a static shape"
    return y.shape


def case_tests(cases: Sequence[OpCase]):
    """The tests every op-case module runs: ``test_forward, test_gradient = case_tests(CASES)``.

    ``test_gradient`` is None when no case is differentiable (nothing to collect)."""

    @pytest.mark.parametrize("case", cases, ids=repr)
    def test_forward(case):
        check_forward(case)

    differentiable = [c for c in cases if c.grad]

    @pytest.mark.parametrize("case", differentiable, ids=repr)
    def test_gradient(case):
        check_grads(case)

    return test_forward, (test_gradient if differentiable else None)
