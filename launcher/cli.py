"""The ``flowmill`` command."""

from __future__ import annotations

import argparse
import os
import sys
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("flowmill")
    except PackageNotFoundError:
        return "unknown"


def _ops(args: argparse.Namespace) -> int:
    """Print every op with the device types it has kernels for and whether it has a gradient."""
    import flowmill.runtime.ops  # noqa: F401  (registers every op)
    from flowmill.kernels import KERNELS
    from flowmill.runtime.autodiff import GRADIENTS
    from flowmill.runtime.op_def import OPS

    devices: dict[str, list[str]] = {}
    for op_type, device in KERNELS:
        devices.setdefault(op_type, []).append(device)
    width = max(map(len, OPS)) + 2
    print(f"{'op':{width}} {'kernels':12} gradient")
    for name in sorted(OPS):
        d = OPS[name]
        grad = "yes" if name in GRADIENTS else ("-" if not d.differentiable else "MISSING")
        kernels = ",".join(sorted(devices.get(name, []))) or "none"
        print(f"{name:{width}} {kernels:12} {grad}")
    return 0


def _run(args: argparse.Namespace) -> int:
    """Run a TrainingJob manifest: ``--local`` as processes on this machine."""
    if not args.local:
        print(
            "flowmill: `flowmill run` runs a job on this machine and needs --local; to run it "
            f"on Kubernetes, apply it there: kubectl apply -f {args.manifest}",
            file=sys.stderr,
        )
        return 2
    from .local import run_manifest

    return run_manifest(args.manifest, workdir=args.workdir, grace=args.grace)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowmill", description="Flowmill training platform")
    parser.add_argument("--version", action="version", version=f"flowmill {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops", help="list ops, their kernels and gradients").set_defaults(fn=_ops)
    run = sub.add_parser(
        "run",
        help="run a TrainingJob manifest",
        description="Run a TrainingJob manifest (the YAML the operator takes). With --local, "
        "every task is a process on this machine: ps tasks serve on free loopback ports, the "
        "chief and workers run their container's command, output is prefixed with the task.",
    )
    run.add_argument("manifest", help="TrainingJob YAML file")
    run.add_argument("--local", action="store_true", help="run the tasks as local processes")
    run.add_argument(
        "--workdir", default=None, help="directory the tasks run in (default: the current one)"
    )
    run.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds a task gets to stop after Shutdown or SIGTERM before SIGKILL (default 10)",
    )
    run.set_defaults(fn=_run)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except BrokenPipeError:
        # The reader stopped early (``flowmill ops | head``): nothing more to say. Python
        # would print the error at exit flushing stdout, so stdout goes to /dev/null.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
