"""The loss curve of a local run as a PNG, so a user sees it without starting TensorBoard.

The points are the run's scalar summaries whose tag names a loss, read from the event
files in its summary directory with the ``tensorboard`` package's own record reader (its
TensorFlow-free one: the launcher never loads TensorFlow). A script that writes no
summaries still gets a curve: the losses the launcher's bar read from the tasks, about
one a second. Drawing needs matplotlib (``pip install 'flowmill[plot]'``); without it the
launcher says so and writes nothing.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

EVENT_GLOB = "events.out.tfevents.*"
MAX_CURVES = 4


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Every scalar summary (TF1 ``simple_value``) in ``logdir``'s event files, by tag, as
    ``(step, value)`` sorted by step (a step written twice, by a restarted chief, keeps its
    last value)."""
    from tensorboard.compat.proto import event_pb2
    from tensorboard.compat.tensorflow_stub import errors
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New

    series: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(os.path.join(logdir, "**", EVENT_GLOB), recursive=True)):
        reader = PyRecordReader_New(path)
        while True:
            try:
                reader.GetNext()
            except (errors.OutOfRangeError, errors.DataLossError):
                break  # the end, or a record still being written
            event = event_pb2.Event.FromString(reader.record())
            for value in event.summary.value:
                if value.WhichOneof("value") == "simple_value":
                    series.setdefault(value.tag, {})[event.step] = value.simple_value
    return {tag: sorted(points.items()) for tag, points in series.items()}


def loss_curves(scalars: dict[str, list[tuple[int, float]]]) -> dict[str, list]:
    """The curves worth drawing: tags naming a loss, else every scalar (a few at most)."""
    losses = {tag: pts for tag, pts in scalars.items() if "loss" in tag.lower()}
    chosen = losses or scalars
    return dict(sorted(chosen.items())[:MAX_CURVES])


def write_loss_plot(path: str, curves: dict[str, Sequence[tuple[int, float]]],
                    title: str) -> str:
    """Draw ``curves`` (tag -> (step, value) points) into the PNG ``path``; returns it."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    try:
        for tag, points in curves.items():
            steps = [s for s, _ in points]
            values = [v for _, v in points]
            ax.plot(steps, values, label=tag, linewidth=1.2)
        ax.set_xlabel("global step")
        ax.set_ylabel("value")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, format="png", bbox_inches="tight")
    finally:
        plt.close(fig)
    return path
