"""Backup workers against a straggler (the TensorFlow paper's Fig. 7), on local sync jobs.

Each configuration is the convnet example (``examples/convnet/train.py``, digits, batch 32)
as a sync job under ``flowmill run --local``: one PS process and worker processes, one of
which (worker 1, never the chief) is made a straggler by ``--straggler-delay``: it sleeps
that long before each of its steps. Every update aggregates the same number of gradients
(2), so the configurations differ only in whether a spare worker exists:

- ``no_backup``: 2 workers, ``backupWorkers: 0``: every step waits for the straggler;
- ``one_backup``: 3 workers, ``backupWorkers: 1``: each step takes the first 2 of the 3
  gradients, and the straggler's (late, for a step already taken) is dropped;
- ``no_straggler``: 2 workers, no delay: what the job does without a slow machine.

The figures are the chief's (worker 0): in sync mode its step ends once the update it
contributed to is applied, so its step time is the job's. The script prints its median
step and its steps per second after the first 5 steps (which build and warm the step);
each configuration runs ``--rounds`` times, rounds interleaved across configurations, and
the figures are the medians over rounds. ``speedup`` is ``no_backup``'s median step time
over ``one_backup``'s. The jobs share the machine's cores with each other's processes, as
they would share a node: on two cores a step of the job took 30-50 ms (6-9 ms in one
process), so the straggler's 0.2 s is four to seven of them.

    python bench/backup_workers.py [--steps 60] [--delay 0.2] [--rounds 2]

The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
SCRIPT = "examples/convnet/train.py"
STRAGGLER = 1
AGGREGATED = 2
STEP_TIMES = re.compile(
    r"^\[worker-0\] step times: (\d+) steps, median ([\d.]+) ms, ([\d.]+) steps/s", re.M
)
ACCURACY = re.compile(r"^\[worker-0\] test_accuracy: ([\d.]+)$", re.M)
# name -> (workers, backup workers, straggler delay?)
CONFIGS = {
    "no_backup": (AGGREGATED, 0, True),
    "one_backup": (AGGREGATED + 1, 1, True),
    "no_straggler": (AGGREGATED, 0, False),
}


def manifest(name: str, workers: int, backup: int, delay: float, steps: int) -> dict:
    args = ["--seed", "1"]
    if delay:
        args += ["--straggler-delay", str(delay), "--straggler-index", str(STRAGGLER)]
    container = {"name": "flowmill", "image": "flowmill:bench", "command": ["python", SCRIPT],
                 "args": args}
    return {
        "apiVersion": "flowmill.dev/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": f"backup-{name.replace('_', '-')}"},
        "spec": {
            "replicaSpecs": {
                "ps": {"replicas": 1},
                "worker": {"replicas": workers, "restartPolicy": "Never",
                           "template": {"spec": {"containers": [container]}}},
            },
            "training": {"mode": "sync", "backupWorkers": backup, "maxSteps": steps},
            "runPolicy": {"backoffLimit": 0},
        },
    }


def run_job(folder: Path, name: str, spec: dict, timeout: float) -> dict:
    """One local job to its end; the chief's step figures and test accuracy."""
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    began = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "flowmill.launcher.cli", "run", str(path), "--local"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )
    wall = time.perf_counter() - began
    out = proc.stdout + proc.stderr
    timing = STEP_TIMES.search(out)
    if proc.returncode != 0 or timing is None:
        raise RuntimeError(f"job {name} exited {proc.returncode} without the chief's step "
                           f"times; its last output:\n{out[-3000:]}")
    accuracy = ACCURACY.search(out)
    return {
        "steps": int(timing.group(1)),
        "median_step_s": float(timing.group(2)) / 1e3,
        "steps_per_s": float(timing.group(3)),
        "test_accuracy": float(accuracy.group(1)) if accuracy else None,
        "job_wall_s": wall,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60, help="global steps per job")
    p.add_argument("--delay", type=float, default=0.2, help="the straggler's sleep per step, s")
    p.add_argument("--rounds", type=int, default=2, help="jobs per configuration")
    p.add_argument("--timeout", type=float, default=300.0, help="per job, seconds")
    p.add_argument("--skip-baseline", action="store_true", help="leave out no_straggler")
    args = p.parse_args(argv)
    names = [n for n in CONFIGS if not (args.skip_baseline and n == "no_straggler")]
    print(f"backup_workers: convnet on digits (batch 32), sync, {AGGREGATED} gradients per "
          f"update, {args.steps} global steps per job, worker {STRAGGLER} sleeps "
          f"{args.delay:g} s per step; {args.rounds} round(s), interleaved", flush=True)
    results: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="flowmill-backup-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                workers, backup, straggles = CONFIGS[name]
                spec = manifest(name, workers, backup, args.delay if straggles else 0.0,
                                args.steps)
                got = run_job(Path(tmp), name, spec, args.timeout)
                results[name].append(got)
                print(f"  round {r + 1} {name:<13} {workers} workers, {backup} backup: "
                      f"median step {got['median_step_s'] * 1e3:7.1f} ms, "
                      f"{got['steps_per_s']:6.2f} steps/s over {got['steps']} steps "
                      f"(job {got['job_wall_s']:.1f} s, test accuracy {got['test_accuracy']})",
                      flush=True)
    summary = {}
    for name, runs in results.items():
        workers, backup, straggles = CONFIGS[name]
        summary[name] = {
            "steps_per_s": round(statistics.median(x["steps_per_s"] for x in runs), 3),
            "median_step_s": round(statistics.median(x["median_step_s"] for x in runs), 4),
            "workers": workers,
            "backup_workers": backup,
            "straggler_delay_s": args.delay if straggles else 0.0,
        }
    speedup = summary["no_backup"]["median_step_s"] / summary["one_backup"]["median_step_s"]
    print(f"  one backup worker: {speedup:.2f}x faster steps than none with a "
          f"{args.delay:g} s straggler")
    print(json.dumps({"bench": "backup_workers", **summary, "speedup": round(speedup, 3),
                      "model": "convnet digits, batch 32", "aggregated": AGGREGATED,
                      "steps": args.steps, "rounds": args.rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
