"""Run a model script unchanged, except that one task hangs after a given step, once.

    python tests/hang_after.py MARKER TASK_INDEX STEP SCRIPT [ARGS...]

The task whose ``task().index`` is TASK_INDEX, in its first life only (MARKER does not
exist yet; it is created), never returns from ``ProgressBar.update`` once its bar reaches
STEP: as a worker stuck in I/O or a deadlock would, it stays alive and serves its
endpoints but makes no step. Used by the stall tests, locally and on the e2e cluster.
"""

from __future__ import annotations

import os
import runpy
import sys
import time

from flowmill.runtime import progress
from flowmill.runtime.job import task


def main() -> None:
    marker, index, at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    update = progress.ProgressBar.update

    def hang_once(self, step=None, **kw):
        update(self, step, **kw)
        if task().index == index and self.step >= at and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"hanging after step {self.step}", flush=True)
            time.sleep(3600)

    progress.ProgressBar.update = hang_once
    sys.argv = sys.argv[4:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
