"""The GPU check in one command: does Flowmill's GPU path work on this machine's GPU, and
what does it cost beside PyTorch eager on the same GPU.

It prints one JSON object as its last line:

- ``parity``: the op suite (``tests/test_gpu_ops.py``: every op case's forward against its
  NumPy reference, every gradient against central differences) run on CuPy, passed/failed;
- ``digits_accuracy``, ``convnet_accuracy``: the examples trained on the GPU;
- ``mlp``: one SGD step of the 784-512-512-10 MLP at batch 256 and 4096, ``conv``: one step
  of the convnet example, each beside PyTorch eager on the same GPU with the same weights
  and data, TF32 off for both (ms, and Flowmill's time over PyTorch's); each step takes
  its batch from host memory, as a feed does;
- ``launch``: elementwise ops per second through a Flowmill step of chained adds on the
  GPU, beside the same adds issued from a CuPy loop;
- ``copies``: host-to-device and device-to-host GB/s of a 256 MB value through a step
  (a feed in, a fetch out), beside CuPy's own copy from and to pinned memory;
- ``cuda_graph``: the MLP step at batch 256 eager and replayed as a CUDA graph
  (``Session(cuda_graphs=True)``), and the speedup;
- ``peak_device_mb``: what CuPy's memory pool holds at the end (it keeps the blocks it
  freed, so this is the most it held).

Without a GPU it says so and skips what needs one (exit status 0). ``--standin`` runs the
same code on the strict stand-in instead, to check the check itself on a machine without a
GPU: its figures measure nothing.

    python bench/gpu/check.py [--quick] [--standin] [--only mlp,conv,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"


SECTIONS = ("parity", "examples", "mlp", "conv", "launch", "copies", "cuda_graph")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and epochs")
    p.add_argument("--standin", action="store_true",
                   help="run on the strict GPU stand-in (no GPU needed; measures nothing)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections, in this order (default all: "
                        f"{','.join(SECTIONS)})")
    args = p.parse_args()
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}: choose from {','.join(SECTIONS)}")
    return args


ARGS = _parse()
if ARGS.standin:
    os.environ["FLOWMILL_STANDIN_GPUS"] = "1"
os.environ.setdefault("CUPY_TF32", "0")
sys.path.insert(0, str(BENCH))

import numpy as np  # noqa: E402


def log(message: str) -> None:
    print(f"gpu check: {message}", file=sys.stderr, flush=True)


def find_gpu() -> tuple[object | None, str]:
    """The GPU array module and the device's name, or None and why not."""
    from flowmill.kernels import ARRAY_MODULES, device_count

    xp = ARRAY_MODULES.get("GPU")
    if xp is None:
        return None, "CuPy is not installed (pip install '.[gpu]')"
    if device_count("GPU") == 0:
        return None, "CuPy finds no GPU (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides them)"
    if ARGS.standin:
        return xp, "stand-in"
    props = xp.cuda.runtime.getDeviceProperties(0)
    return xp, props["name"].decode() if isinstance(props["name"], bytes) else props["name"]


def torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def median_ms(fn, steps: int, repeats: int = 5) -> float:
    for _ in range(3):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            fn()
        samples.append((time.perf_counter() - start) / steps * 1e3)
    return statistics.median(samples)


def run_script(args: list[str], pattern: str, timeout: float) -> float:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=os.environ)
    if proc.returncode:
        raise RuntimeError(f"{args[0]} exited {proc.returncode}: {proc.stderr[-600:]}")
    found = re.findall(pattern, proc.stdout)
    if not found:
        raise RuntimeError(f"{args[0]} printed no {pattern!r}")
    return float(found[-1])


# ---- the sections: each returns what goes into the JSON


def parity() -> dict:
    env = {**os.environ, "FLOWMILL_TEST_GPU": "stand-in" if ARGS.standin else "cupy"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu_ops.py"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|error)", tail)}
    failed = re.findall(r"^FAILED (\S+)", proc.stdout, re.M)
    return {"passed": counts.get("passed", 0),
            "failed": counts.get("failed", 0) + counts.get("error", 0),
            "failures": failed[:20]}


def examples() -> dict:
    digits = run_script(["examples/digits/train.py"], r"test_accuracy: (\d\.\d+)", 300)
    epochs = ["--epochs", "2"] if ARGS.quick else []
    convnet = run_script(["examples/convnet/train.py", *epochs],
                         r"test_accuracy: (\d\.\d+)", 420)
    return {"digits_accuracy": digits, "convnet_accuracy": convnet}


def mlp(torch) -> dict:
    import mlp_step

    out = {}
    for batch in (256, 4096):
        params, x, y = mlp_step.make_problem(batch)
        fast, _, _ = mlp_step.flowmill_step(params, x, y, 0.01, device="/gpu:0")
        steps = 20 if ARGS.quick else 100
        entry = {"first_loss": {"flowmill": round(fast(), 5)}}
        entry["flowmill_ms"] = round(median_ms(fast, steps), 3)
        if torch is not None:
            theirs = mlp_step.torch_step(params, x, y, 0.01, 1, device="cuda")
            entry["first_loss"]["torch"] = round(theirs(), 5)
            entry["torch_ms"] = round(median_ms(theirs, steps), 3)
            entry["ratio"] = round(entry["flowmill_ms"] / entry["torch_ms"], 3)
        out[str(batch)] = entry
    return out


def conv(torch) -> dict:
    import conv_step

    args = conv_step.ARGS
    example = conv_step.load_example()
    params, x, y, side = conv_step.make_problem(args)
    fast, _ = conv_step.flowmill_step(example, params, x, y, args, args.dropout,
                                      device="/gpu:0")
    steps = 10 if ARGS.quick else 50
    out = {"flowmill_ms": round(median_ms(fast, steps), 3), "batch": args.batch}
    if torch is not None:
        theirs = conv_step.torch_step(params, x, y, args, args.dropout, side, device="cuda")
        out["torch_ms"] = round(median_ms(theirs, steps), 3)
        out["ratio"] = round(out["flowmill_ms"] / out["torch_ms"], 3)
    return out


def cuda_graph() -> dict:
    import mlp_step

    params, x, y = mlp_step.make_problem(256)
    steps = 20 if ARGS.quick else 100
    eager, _, _ = mlp_step.flowmill_step(params, x, y, 0.01, device="/gpu:0")
    replayed, _, plan = mlp_step.flowmill_step(params, x, y, 0.01, device="/gpu:0",
                                               cuda_graphs=True)
    out = {"eager_ms": round(median_ms(eager, steps), 3),
           "replay_ms": round(median_ms(replayed, steps), 3),
           "captured": type(plan).__name__ == "GraphedPlan",
           "segments": len(getattr(plan, "runners", ())),
           "eager_segments": sum(r.failed is not None for r in getattr(plan, "runners", ()))}
    out["speedup"] = round(out["eager_ms"] / out["replay_ms"], 3)
    return out


def launch(xp) -> dict:
    """Elementwise ops per second: a step of ``n`` chained adds on a small GPU vector,
    each its own launch (fusion off: it would make the chain one kernel, and this
    measures what a launch costs)."""
    import flowmill.runtime as fm
    from flowmill.runtime import fusion

    n = 200
    graph = fm.Graph()
    with graph.as_default(), fm.device("/gpu:0"):
        v = fm.Variable(np.zeros(16, np.float32))
        h = v.read_value()
        for _ in range(n):
            h = h + 1.0
        total = fm.reduce_sum(h)
    fused, fusion.ENABLED = fusion.ENABLED, False
    try:
        with fm.Session(graph) as sess:
            sess.run(v.initializer)
            step = sess.make_callable(total)
            ms = median_ms(step, 20)
    finally:
        fusion.ENABLED = fused
    value = xp.zeros(16, np.float32)

    def raw():
        h = value
        for _ in range(n):
            h = h + 1.0
        return float(h.sum())

    raw_ms = median_ms(raw, 20)
    return {"ops_per_s": round(n / ms * 1e3), "cupy_ops_per_s": round(n / raw_ms * 1e3)}


def copies(xp) -> dict:
    """GB/s of a 256 MB float32 value: fed to a GPU op, and fetched from one."""
    import flowmill.runtime as fm

    mb = 16 if ARGS.quick else 256
    n = mb * 2**20 // 4
    host = np.ones(n, np.float32)
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, [n])
        with fm.device("/gpu:0"):
            small = fm.reduce_sum(x)  # the feed goes up, a scalar comes back
            big = fm.zeros([n]) + 1.0  # a value made on the GPU comes back whole
    with fm.Session(graph) as sess:
        feed, fetch = sess.make_callable(small, [x]), sess.make_callable(big)
        up = median_ms(lambda: feed(host), 5)
        down = median_ms(fetch, 5)
    gb = n * 4 / 1e9
    pinned = _pinned(xp, n)
    device = xp.zeros(n, np.float32)

    def raw_up():
        device.set(pinned)
        xp.cuda.Device(0).synchronize()

    def raw_down():
        device.get(out=pinned)

    return {"mb": mb, "h2d_gb_s": round(gb / up * 1e3, 2), "d2h_gb_s": round(gb / down * 1e3, 2),
            "raw_h2d_gb_s": round(gb / median_ms(raw_up, 5) * 1e3, 2),
            "raw_d2h_gb_s": round(gb / median_ms(raw_down, 5) * 1e3, 2)}


def _pinned(xp, n: int) -> np.ndarray:
    if ARGS.standin:
        return np.ones(n, np.float32)
    import cupyx

    out = cupyx.empty_pinned((n,), np.float32)
    out[...] = 1.0
    return out


def section(result: dict, name: str, fn, *args) -> None:
    start = time.perf_counter()
    try:
        result[name] = fn(*args)
    except Exception as e:  # noqa: BLE001 - one section failing must not hide the others
        result[name] = None
        result.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:800]
    # Each section's figures as they come: a run cut off at its time limit keeps them.
    log(f"{name} in {time.perf_counter() - start:.1f} s: "
        f"{json.dumps(result[name] if result[name] is not None else result['errors'][name])}")


def main() -> int:
    result: dict = {"bench": "gpu_check"}
    xp, what = find_gpu()
    if xp is None:
        log(f"no GPU: {what}; every GPU figure is skipped")
        result.update(gpu=None, skipped=what)
        print(json.dumps(result))
        return 0
    result["gpu"] = what
    torch = None if ARGS.standin else torch_cuda()
    if torch is None:
        log("PyTorch with CUDA is not here: the PyTorch figures are skipped")
    result["tf32"] = False
    runs = {"parity": (parity,), "examples": (examples,), "mlp": (mlp, torch),
            "conv": (conv, torch), "launch": (launch, xp), "copies": (copies, xp),
            "cuda_graph": (cuda_graph,)}
    for name in ARGS.only.split(","):
        section(result, name, *runs[name])
    pool = xp.get_default_memory_pool()
    result["peak_device_mb"] = round(pool.total_bytes() / 2**20, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
