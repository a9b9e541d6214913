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
    """Print every op with the device types it has kernels for here, whether it has a
    gradient, and whether it runs on a GPU (on any machine: why not, or how it differs)."""
    import flowmill.runtime.ops  # noqa: F401  (registers every op)
    from flowmill.kernels import KERNELS, gpu_support
    from flowmill.runtime.autodiff import GRADIENTS
    from flowmill.runtime.op_def import OPS

    devices: dict[str, list[str]] = {}
    for op_type, device in KERNELS:
        devices.setdefault(op_type, []).append(device)
    width = max(map(len, OPS)) + 2
    print(f"{'op':{width}} {'kernels':12} {'gradient':9} GPU")
    for name in sorted(OPS):
        d = OPS[name]
        grad = "yes" if name in GRADIENTS else ("-" if not d.differentiable else "MISSING")
        kernels = ",".join(sorted(devices.get(name, []))) or "none"
        print(f"{name:{width}} {kernels:12} {grad:9} {gpu_support(name)}")
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


def _port(text: str) -> int:
    port = int(text)
    if not 0 <= port < 65536:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0 to 65535; 0: any free one)")
    return port


def _serve(args: argparse.Namespace) -> int:
    """Serve an export over TensorFlow Serving's REST API until SIGTERM or Ctrl-C."""
    from flowmill.runtime.saved_model import SavedModelError

    from .serve import serve

    try:
        return serve(args.path, args.host, args.port, args.name, args.max_body_bytes)
    except (SavedModelError, OSError, ValueError) as e:
        print(f"flowmill serve: {e}", file=sys.stderr)
        return 1


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
        "--workdir", default=None,
        help="directory the tasks run in (default: the current one when the command's "
        "script is there, else the manifest's directory or the nearest one above it "
        "that holds it)"
    )
    run.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="seconds a task gets to stop after Shutdown or SIGTERM before SIGKILL (default 10)",
    )
    run.set_defaults(fn=_run)
    serve = sub.add_parser(
        "serve",
        help="serve an exported model over TensorFlow Serving's REST API",
        description="Serve an export (flowmill.runtime.saved_model.save) over TensorFlow "
        "Serving's REST API: GET /v1/models/NAME (status), GET /v1/models/NAME/metadata "
        "(signature), POST /v1/models/NAME:predict. Prints one line with the URL when ready; "
        "SIGTERM or Ctrl-C stops it.",
    )
    serve.add_argument("path", help="the export: a directory, file:// or s3:// URI")
    serve.add_argument("--port", type=_port, default=8501, help="port (default 8501; 0: any free)")
    serve.add_argument("--host", default="127.0.0.1", help="address (default 127.0.0.1)")
    serve.add_argument(
        "--name", default=None, help="the model's name in URLs (default: the export's directory)"
    )
    serve.add_argument(
        "--max-body-bytes",
        type=int,
        default=16 << 20,
        help="largest request body accepted, in bytes (default 16 MiB)",
    )
    serve.set_defaults(fn=_serve)
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
