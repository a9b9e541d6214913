"""The digits example end to end, as a user runs it: a subprocess with the repo's Python."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "examples" / "digits" / "train.py"
LAST_LINE = re.compile(r"^test_accuracy: (\d\.\d{4})$")

pytest.importorskip("sklearn", reason="the digits example needs scikit-learn's bundled data")


def _run(*args: str) -> tuple[float, str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=SCRIPT.parents[2],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = proc.stdout.rstrip("\n").splitlines()[-1]
    match = LAST_LINE.match(last)
    assert match, f"last stdout line is {last!r}, expected 'test_accuracy: <value>'"
    return float(match.group(1)), proc.stderr


@pytest.mark.slow
def test_digits_trains_to_97_percent_deterministically():
    accuracy, stderr = _run()
    assert accuracy >= 0.97, f"test accuracy {accuracy} is below 0.97"
    # Off a terminal the progress bar writes plain lines, ending at the last step.
    lines = [line for line in stderr.splitlines() if "step" in line]
    assert lines and "\r" not in stderr
    assert re.search(r"step (\d+)/\1 ", lines[-1]), lines[-1]
    again, _ = _run()
    assert again == accuracy, f"same seed, different accuracy: {accuracy} then {again}"
