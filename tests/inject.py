"""Run a model script unchanged, with one fault injected, as the fault tests need it.

    python tests/inject.py hang MARKER TASK_INDEX STEP SCRIPT [ARGS...]
    python tests/inject.py crash MARKER TASK_INDEX STEP DELAY SCRIPT [ARGS...]
    python tests/inject.py nan-digits EVERY SCRIPT [ARGS...]

``hang``: the task whose ``task().index`` is TASK_INDEX, in its first life only (MARKER
does not exist yet; it is created), never returns from ``ProgressBar.update`` once its bar
reaches STEP: as a worker stuck in I/O or a deadlock would, it stays alive and serves its
endpoints but makes no step.

``crash``: that task, in its first life, exits 1 once its bar reaches STEP; in its next
life it takes DELAY seconds before it starts (a slow start: imports, a big restore).

``nan-digits``: scikit-learn's bundled digits (what ``examples/digits`` trains on) have a
NaN pixel in every EVERY-th image: a bad record in the data, which spreads into every
weight unless the job checks numerics.

Used by the fault tests, locally and on the e2e cluster.
"""

from __future__ import annotations

import os
import runpy
import sys
import time


def hang(marker: str, index: int, at: int) -> None:
    from flowmill.runtime import progress
    from flowmill.runtime.job import task

    update = progress.ProgressBar.update

    def hang_once(self, step=None, **kw):
        update(self, step, **kw)
        if task().index == index and self.step >= at and not os.path.exists(marker):
            open(marker, "w").close()
            print(f"hanging after step {self.step}", flush=True)
            time.sleep(3600)

    progress.ProgressBar.update = hang_once


def crash(marker: str, index: int, at: int, delay: float) -> None:
    from flowmill.runtime import progress
    from flowmill.runtime.job import task

    if task().index == index and os.path.exists(marker):
        print(f"starting again in {delay:g}s", flush=True)
        time.sleep(delay)
        return
    update = progress.ProgressBar.update

    def crash_once(self, step=None, **kw):
        update(self, step, **kw)
        if task().index == index and self.step >= at:
            open(marker, "w").close()
            print(f"crashing after step {self.step}", flush=True)
            os._exit(1)

    progress.ProgressBar.update = crash_once


def nan_digits(every: int) -> None:
    import numpy as np
    import sklearn.datasets

    load = sklearn.datasets.load_digits

    def load_with_nans(*args, **kwargs):
        digits = load(*args, **kwargs)
        digits.data = digits.data.astype(np.float64)
        digits.data[::every, 10] = np.nan
        return digits

    sklearn.datasets.load_digits = load_with_nans


def main() -> None:
    fault, args = sys.argv[1], sys.argv[2:]
    if fault == "hang":
        hang(args[0], int(args[1]), int(args[2]))
        rest = args[3:]
    elif fault == "crash":
        crash(args[0], int(args[1]), int(args[2]), float(args[3]))
        rest = args[4:]
    elif fault == "nan-digits":
        nan_digits(int(args[0]))
        rest = args[1:]
    else:
        raise SystemExit(f"unknown fault {fault!r} (hang, crash, nan-digits)")
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
