import os
import subprocess
import sys


def test_ops_lists_every_op_with_kernels_and_no_missing_gradient():
    out = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "ops"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["op", "kernels", "gradient"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["MatMul"] == ["CPU", "yes"]
    assert rows["NoOp"] == ["CPU", "-"]
    assert not [
        op for op, (kernels, grad) in rows.items() if grad == "MISSING" or kernels == "none"
    ]


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "--version"], capture_output=True, text=True
    ).stdout
    assert out.startswith("flowmill ")


def test_ops_into_a_reader_that_stops_early_ends_quietly():
    """``flowmill ops | head -1``: the pipe closes under the listing; no traceback. Here
    the reader is gone before the first write, so every run meets the closed pipe."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "flowmill.launcher.cli", "ops"],
            stdout=write, stderr=subprocess.PIPE, timeout=60,
        )
    finally:
        os.close(write)
    assert proc.returncode == 0, proc.stderr
    assert b"Traceback" not in proc.stderr and b"BrokenPipe" not in proc.stderr, proc.stderr
