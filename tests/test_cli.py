import os
import subprocess
import sys


def _ops(**env) -> dict[str, list[str]]:
    out = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "ops"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    ).stdout
    lines = out.splitlines()
    assert lines[0].split() == ["op", "kernels", "gradient", "GPU"]
    return {line.split()[0]: line.split(None, 3)[1:] for line in lines[1:]}


def test_ops_lists_every_op_with_kernels_and_no_missing_gradient():
    rows = _ops()
    assert rows["MatMul"] == ["CPU", "yes", "yes"]
    assert rows["NoOp"] == ["CPU", "-", "yes"]
    assert not [
        op for op, (kernels, grad, _) in rows.items() if grad == "MISSING" or kernels == "none"
    ]


def test_ops_says_which_ops_run_on_a_gpu_and_why_not():
    """On any machine; with a GPU (here the stand-in) its kernels show beside the CPU's."""
    rows = _ops()
    assert rows["QueueEnqueueV2"][2].startswith("no: a queue holds values")
    assert rows["Gather"][2].startswith("yes: out-of-range indices wrap around")
    with_gpu = _ops(FLOWMILL_STANDIN_GPUS="1")
    assert with_gpu["MatMul"][0] == "CPU,GPU"
    assert with_gpu["QueueEnqueueV2"][0] == "CPU"


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
