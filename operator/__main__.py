"""``python -m flowmill.operator [kopf run options]``: the operator, as the image runs it.

The same as ``kopf run -m flowmill.operator.controller [options]``, less the official
Kubernetes client: kopf imports that library whenever it is installed, to recognise its
model classes, and it costs about 30 MB of memory that the operator, which speaks JSON to
the API itself (``apiclient.py``), never uses. Where the library is installed anyway (a
development environment with the tests' dependencies) this entry point keeps kopf from
loading it, so the operator runs as light there as in its image.
"""

from __future__ import annotations

import sys

for _name in ("kubernetes", "kubernetes_asyncio", "pykube"):
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]  # import raises ImportError

from kopf import cli  # noqa: E402  (after the modules it must not load are ruled out)

if __name__ == "__main__":
    cli.main(args=["run", "-m", "flowmill.operator.controller", *sys.argv[1:]],
             prog_name="python -m flowmill.operator")
