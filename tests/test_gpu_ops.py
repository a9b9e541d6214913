"""The op suite on a GPU: every op case (``CASES`` of the ``test_ops_*`` modules and the
others) is built under ``device("/gpu:0")`` and run on the strict GPU stand-in, checked
against the same NumPy reference, and every differentiable case's gradient against central
differences. (Ops the graph does not place go to the GPU by themselves, but variables stay
on the CPU unless asked: asking puts the state ops' GPU kernels to the test too.)

An op that cannot run on a GPU must say why (``kernels.HOST_ONLY``); the rest must have a
GPU kernel. Random ops draw a different stream on a GPU (as CuPy's cuRAND does), so their
cases are checked for shape, dtype and range instead of values.
"""

from __future__ import annotations

import importlib
import pathlib

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels import HOST_ONLY, KERNELS
from flowmill.runtime import placement
from flowmill.runtime.op_def import OPS

from opcheck import OpCase, build_case, check_forward, check_grads

GPU = "/gpu:0"
RANDOM_OPS = {"RandomUniform", "RandomStandardNormal", "TruncatedNormal"}


def _cases() -> list[OpCase]:
    cases = []
    for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        if path.stem in ("test_op_coverage", "test_gpu_ops"):
            continue
        if "CASES" not in path.read_text():
            continue  # importing it would only risk its own skips (a tool it needs, absent)
        try:
            module = importlib.import_module(path.stem)
        except pytest.skip.Exception:
            continue  # a module that skips itself here (what it needs is absent)
        cases.extend(c for c in getattr(module, "CASES", []) if isinstance(c, OpCase))
    for case in cases:
        if not case.op_types:
            build_case(case)
    return cases


CASES = _cases()


@pytest.fixture(autouse=True)
def _every_kernel_on_the_gpu(monkeypatch):
    """Small integer results would otherwise be computed on the host."""
    monkeypatch.setattr(placement, "KEEP_SHAPE_MATH_ON_THE_HOST", False)
RANDOM = [c for c in CASES if c.op_types & RANDOM_OPS]
VALUED = [c for c in CASES if not c.op_types & RANDOM_OPS]


@pytest.mark.parametrize("case", VALUED, ids=repr)
def test_forward_on_the_gpu(standin_gpu, case):
    check_forward(case, device=GPU)
    counts = standin_gpu.counts()
    if counts is not None and case.op_types - set(HOST_ONLY) - {"Const", "Identity", "NoOp"}:
        assert counts["h2d"] + counts["d2h"] > 0, f"{case.id}: nothing crossed to the GPU"


@pytest.mark.parametrize("case", [c for c in VALUED if c.grad], ids=repr)
def test_gradient_on_the_gpu(standin_gpu, case):
    check_grads(case, device=GPU)


@pytest.mark.parametrize("case", RANDOM, ids=repr)
def test_random_ops_draw_their_own_stream_on_the_gpu(standin_gpu, case):
    graph, feeds, outputs = build_case(case, device=GPU)

    with fm.Session(graph) as sess:
        got = sess.run(outputs, dict(zip(feeds, [np.asarray(v) for v in case.inputs],
                                         strict=True)))
    want = case.reference(*[np.asarray(v) for v in case.inputs])
    want = want if isinstance(want, (list, tuple)) else [want]
    for g, w in zip(got, want, strict=True):
        w = np.asarray(w)
        assert g.shape == w.shape and g.dtype == w.dtype, case.id
        assert np.all(np.isfinite(g)), case.id
        if g.size > 1:
            assert not np.array_equal(g, w), f"{case.id}: the GPU stream is NumPy's"


def test_every_op_runs_on_the_gpu_or_says_why_not(standin_gpu):
    internal = {"Placeholder", "_Arg"}
    missing = sorted(
        name for name in OPS
        if name not in internal and name not in HOST_ONLY and (name, "GPU") not in KERNELS
    )
    assert not missing, f"ops with neither a GPU kernel nor a reason: {missing}"
    assert all(reason.strip() for reason in HOST_ONLY.values())
    assert not {name for name in HOST_ONLY if (name, "GPU") in KERNELS}
