"""``bench/gpu/check.py``, the GPU check, where there is no GPU: it says so and skips, and
on the strict stand-in every section of it runs (its figures measure nothing there)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

CHECK = pathlib.Path(__file__).resolve().parents[1] / "bench" / "gpu" / "check.py"


def _check(*args: str, timeout: float) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLOWMILL_STANDIN")}
    proc = subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=CHECK.parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_without_a_gpu_the_check_says_so_and_skips():
    pytest.importorskip("numpy")
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here")
    result, err = _check(timeout=120)
    assert result == {"bench": "gpu_check", "gpu": None,
                      "skipped": "CuPy is not installed (pip install '.[gpu]')"}
    assert "no GPU: CuPy is not installed" in err


@pytest.mark.slow
def test_on_the_stand_in_every_section_of_the_check_runs():
    pytest.importorskip("sklearn", reason="the examples need scikit-learn's bundled data")
    result, _ = _check("--standin", "--quick", timeout=900)
    assert result["gpu"] == "stand-in" and "errors" not in result, result.get("errors")
    assert result["parity"]["failed"] == 0 and result["parity"]["passed"] > 500
    assert result["examples"]["digits_accuracy"] >= 0.95
    assert set(result["mlp"]) == {"256", "4096"}
    assert result["launch"]["ops_per_s"] > 0 and result["copies"]["h2d_gb_s"] > 0
    assert result["cuda_graph"]["captured"] and result["cuda_graph"]["speedup"] > 0
