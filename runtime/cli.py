"""The ``flowmill`` command."""

from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError, version


def _version() -> str:
    try:
        return version("flowmill")
    except PackageNotFoundError:
        return "unknown"


def _ops(args: argparse.Namespace) -> int:
    """Print every op with the device types it has kernels for and whether it has a gradient."""
    import flowmill.runtime  # noqa: F401  (registers ops)
    from flowmill.kernels import KERNELS

    from .gradients import GRADIENTS
    from .op_def import OPS

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flowmill", description="Flowmill training platform")
    parser.add_argument("--version", action="version", version=f"flowmill {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("ops", help="list ops, their kernels and gradients").set_defaults(fn=_ops)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
