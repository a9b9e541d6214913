"""Every registered op has a forward check; every differentiable op a numerical gradient check."""

import importlib
import pathlib

import pytest

from flowmill.runtime.op_def import OPS

from opcheck import OpCase, build_case

# Placeholders feed every case, so they are exercised everywhere but recorded nowhere;
# _Send/_Recv exist only in partitioned steps and are checked in test_partition.py, the
# host/device copies only in steps with a GPU, checked in test_gpu_placement.py.
INTERNAL = {"Placeholder", "_Send", "_Recv", "_HostToDevice", "_DeviceToHost", "_HostScalar",
            "_FusedElementwise", "_FusedAssign", "_DeviceCopy", "_CudaGraphSegment"}


def _all_cases():
    cases = []
    for path in sorted(pathlib.Path(__file__).parent.glob("test_*.py")):
        if path.stem == "test_op_coverage":
            continue
        module = importlib.import_module(path.stem)
        cases.extend(c for c in getattr(module, "CASES", []) if isinstance(c, OpCase))
    return cases


@pytest.fixture(scope="module")
def coverage():
    forward, grad = set(), set()
    for case in _all_cases():
        case.op_types.clear()
        build_case(case)
        forward |= case.op_types
        if case.grad:
            grad |= case.op_types
    return forward, grad


def test_every_op_has_a_forward_check(coverage):
    forward, _ = coverage
    missing = sorted(set(OPS) - INTERNAL - forward)
    assert not missing, f"ops with no forward check against a reference: {missing}"


def test_every_differentiable_op_has_a_gradient_check(coverage):
    _, grad = coverage
    differentiable = {name for name, d in OPS.items() if d.differentiable} - INTERNAL
    missing = sorted(differentiable - grad)
    assert not missing, f"differentiable ops with no numerical gradient check: {missing}"
