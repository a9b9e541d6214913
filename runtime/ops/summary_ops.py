"""Summary ops (``fm.summary``): what TensorBoard shows of a tensor, as TensorFlow 1.x's
``tf.summary`` builds it.

Each op outputs its value as a serialized ``Summary`` protocol buffer (a uint8 vector, see
``flowmill.kernels.summary``) and joins the graph's ``GraphKeys.SUMMARIES`` collection, so
``merge_all()`` gathers them into one tensor a loop fetches every N steps and hands to
``FileWriter.add_summary``. Tags follow TensorFlow's rule: the summary's name inside the
current name scope (``train/loss``), made unique like an op name, with ``family`` as an
outer scope when given.
"""

from __future__ import annotations

from collections.abc import Sequence

from flowmill.kernels.shapes import ShapeError

from .. import dtypes
from ..graph import GraphKeys, Tensor, apply_op, convert_to_tensor, get_default_graph
from ..op_def import define_op

_SERIALIZED = [(dtypes.uint8, (None,))]


def _one_input(op_type: str, kinds: str):
    def shape_fn(inputs, attrs):
        if inputs[0].dtype.kind not in kinds:
            raise ShapeError(f"{op_type} cannot summarize a {inputs[0].dtype} tensor")
        if not attrs["tag"]:
            raise ShapeError(f"{op_type} needs a tag")
        return _SERIALIZED
    return shape_fn


define_op("ScalarSummary", attrs={"tag": ""}, num_inputs=1, differentiable=False)(
    _one_input("ScalarSummary", "iuf"))
define_op("HistogramSummary", attrs={"tag": ""}, num_inputs=1, differentiable=False)(
    _one_input("HistogramSummary", "iuf"))
define_op("ImageSummary", attrs={"tag": "", "max_outputs": 3}, num_inputs=1,
          differentiable=False)(_one_input("ImageSummary", "uf"))
define_op("TextSummary", attrs={"tag": ""}, num_inputs=1, differentiable=False)(
    _one_input("TextSummary", "SUO"))


@define_op("MergeSummary", differentiable=False)
def _merge_shape(inputs, attrs):
    if not inputs:
        raise ShapeError("MergeSummary needs at least one summary")
    for i, t in enumerate(inputs):
        if t.dtype != dtypes.uint8 or t.shape is None or len(t.shape) != 1:
            raise ShapeError(f"input {i} is not a serialized summary (a uint8 vector)")
    return _SERIALIZED


def _summary(op_type: str, name: str, tensor, family: str | None,
             collections: Sequence[str] | None, **attrs) -> Tensor:
    if not name or not isinstance(name, str):
        raise ValueError(f"a summary needs a name (a non-empty string), got {name!r}")
    tensor = convert_to_tensor(tensor)
    graph = tensor.graph if isinstance(tensor, Tensor) else get_default_graph()
    scoped = f"{family}/{name}" if family else name
    with graph.name_scope(scoped) as scope:
        tag = scope.rstrip("/")
        out = apply_op(op_type, [tensor], {"tag": tag, **attrs}, name=op_type).outputs[0]
    for key in (GraphKeys.SUMMARIES,) if collections is None else collections:
        graph.add_to_collection(key, out)
    return out


def scalar(name: str, tensor, collections: Sequence[str] | None = None,
           family: str | None = None) -> Tensor:
    """A scalar's value over steps (TensorBoard's Scalars tab)."""
    return _summary("ScalarSummary", name, tensor, family, collections)


def histogram(name: str, values, collections: Sequence[str] | None = None,
              family: str | None = None) -> Tensor:
    """The distribution of a tensor's values (the Histograms and Distributions tabs); a
    NaN or Inf among them fails the step, naming the tag, as in TensorFlow."""
    return _summary("HistogramSummary", name, values, family, collections)


def image(name: str, tensor, max_outputs: int = 3, collections: Sequence[str] | None = None,
          family: str | None = None) -> Tensor:
    """Up to ``max_outputs`` images of a ``[batch, height, width, 1|3|4]`` tensor, as PNG:
    uint8 as is, floats scaled as TensorFlow 1.x scales them."""
    if not isinstance(max_outputs, int) or max_outputs < 1:
        raise ValueError(f"image summary {name!r}: max_outputs must be a positive int, "
                         f"got {max_outputs!r}")
    return _summary("ImageSummary", name, tensor, family, collections, max_outputs=max_outputs)


def text(name: str, tensor, collections: Sequence[str] | None = None) -> Tensor:
    """Strings (Markdown) for TensorBoard's Text tab."""
    return _summary("TextSummary", name, tensor, None, collections)


def merge(inputs: Sequence[Tensor], collections: Sequence[str] | None = None,
          name: str | None = None) -> Tensor:
    """One serialized summary holding every value of ``inputs`` (their tags must differ)."""
    inputs = [convert_to_tensor(t) for t in inputs]
    out = apply_op("MergeSummary", inputs, name=name or "MergeSummary").outputs[0]
    for key in collections or ():
        out.graph.add_to_collection(key, out)
    return out


def merge_all(key: str = GraphKeys.SUMMARIES, scope: str | None = None,
              graph=None) -> Tensor | None:
    """Every summary in the graph's collection ``key`` merged, or None when there is none
    (as in TensorFlow, so a script can skip writing)."""
    graph = graph or get_default_graph()
    summaries = graph.get_collection(key, scope)
    if not summaries:
        return None
    with graph.as_default():
        return merge(summaries)
