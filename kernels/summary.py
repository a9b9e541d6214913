"""Summary kernels: a tensor's value as a serialized TensorBoard ``Summary`` protocol buffer.

Each kernel writes what TensorFlow 1.x's kernel of the same name writes, in the protos of
the ``tensorboard`` package, so TensorBoard (and any reader of TF1 event files) reads it
unchanged: a scalar as ``simple_value``, a histogram as a ``HistogramProto`` over
TensorFlow's default bucket limits, images as PNG-encoded ``Summary.Image`` values, text
as a string tensor tagged for the text plugin. ``MergeSummary`` concatenates serialized
summaries, which protocol buffers define as merging them, after checking tags are unique.

The output is the serialized bytes as a uint8 vector (as ``ShardSaved`` returns its JSON):
a numeric tensor, so it is fetched, fed and sent between tasks like any other. The
summary ops run only on the steps that fetch them, so none of this costs a training step.
"""

from __future__ import annotations

import io

import numpy as np

from .debug import InvalidArgumentError
from .registry import KernelContext, kernel, to_host

_HOST = "builds summary protocol buffers from host values"


def _pb():
    """TensorBoard's protos, loaded when a summary kernel is first built (not at import:
    a step without summaries never pays for them)."""
    from tensorboard.compat.proto import summary_pb2

    return summary_pb2


def _as_bytes(summary) -> np.ndarray:
    return np.frombuffer(summary.SerializeToString(), np.uint8)


@kernel("ScalarSummary", host_only=_HOST)
def _scalar(ctx: KernelContext):
    pb, tag, name = _pb(), ctx.attrs["tag"], ctx.name

    def fn(x):
        x = to_host(x)
        if x.size != 1:
            raise InvalidArgumentError(
                f"op {name!r} (ScalarSummary): tag {tag!r} needs a scalar, got shape {x.shape}"
            )
        value = pb.Summary.Value(tag=tag, simple_value=float(x.reshape(()).item()))
        return _as_bytes(pb.Summary(value=[value]))

    return fn


def _default_bucket_limits() -> np.ndarray:
    """TensorFlow's default histogram buckets (``histogram.cc``): limits that grow by 10%
    from 1e-12 to 1e20, mirrored below zero, with zero and +-DBL_MAX at the ends."""
    positive, v = [], 1.0e-12
    while v < 1.0e20:
        positive.append(v)
        v *= 1.1
    positive.append(np.finfo(np.float64).max)
    negative = [-p for p in reversed(positive)]
    return np.array(negative + [0.0] + positive)


BUCKET_LIMITS = _default_bucket_limits()
_POSITIVE = (len(BUCKET_LIMITS) - 3) // 2  # limits in (0, DBL_MAX): 1e-12 * 1.1**k
_ZERO = _POSITIVE + 1  # the index of the 0.0 limit
_LOG_GROWTH = np.log(1.1)
_LOG_SMALLEST = np.log(1e-12)


def bucket_index(v: np.ndarray) -> np.ndarray:
    """``upper_bound(BUCKET_LIMITS, v)`` per value (the first limit above it), as
    TensorFlow's ``Histogram::Add`` finds a bucket: from the limits' closed form
    ``1e-12 * 1.1**k``, then one exact correction each way against the limits themselves
    (a binary search over 1,550 limits costs several times as much)."""
    a = np.abs(v)
    k = np.floor((np.log(np.maximum(a, 1e-300)) - _LOG_SMALLEST) / _LOG_GROWTH)
    at_most = np.clip(k + 1, 0, _POSITIVE).astype(np.int64)  # about #{limits in (0, a]}
    idx = np.where(v > 0, _ZERO + 1 + at_most,
                   np.where(v < 0, 1 + _POSITIVE - at_most, _ZERO + 1))
    last = len(BUCKET_LIMITS)
    idx = np.clip(idx, 1, last)
    idx -= BUCKET_LIMITS[idx - 1] > v  # the limit below must not exceed v
    idx += (idx < last) & (BUCKET_LIMITS[np.minimum(idx, last - 1)] <= v)  # nor this one
    return np.minimum(idx, last - 1)


def histogram_proto(values: np.ndarray, histo_cls):
    """A ``HistogramProto`` of ``values`` as TensorFlow encodes one: a value ``v`` counts in
    the first bucket whose limit exceeds it, and runs of empty buckets are collapsed into
    the last of them (``preserve_zero_buckets=false``)."""
    v = values.astype(np.float64).ravel()
    counts = np.bincount(bucket_index(v), minlength=len(BUCKET_LIMITS))
    nonzero = counts != 0
    # Keep every non-empty bucket, and of each run of empty ones only its last.
    keep = nonzero | np.append(nonzero[1:], True)
    histo = histo_cls(
        min=float(v.min()) if v.size else 0.0,
        max=float(v.max()) if v.size else 0.0,
        num=float(v.size),
        sum=float(v.sum()),
        sum_squares=float(np.dot(v, v)),
    )
    histo.bucket_limit.extend(BUCKET_LIMITS[keep].tolist())
    histo.bucket.extend(counts[keep].astype(np.float64).tolist())
    return histo


@kernel("HistogramSummary", host_only=_HOST)
def _histogram(ctx: KernelContext):
    pb, tag, name = _pb(), ctx.attrs["tag"], ctx.name

    def fn(x):
        x = to_host(x)
        if x.dtype.kind == "f" and not np.isfinite(x).all():
            what = "NaN" if np.isnan(x).any() else "Inf"
            raise InvalidArgumentError(
                f"op {name!r} (HistogramSummary): {what} in summary histogram for {tag!r}"
            )
        value = pb.Summary.Value(tag=tag, histo=histogram_proto(x, pb.HistogramProto))
        return _as_bytes(pb.Summary(value=[value]))

    return fn


def _to_uint8(images: np.ndarray) -> np.ndarray:
    """TensorFlow 1.x's image summary scaling, one image at a time: uint8 as is; a float
    image with no negative value scaled so its largest is 255, else so 0.0 lands on 128
    and the largest magnitude on 0 or 255. Pixels that are not finite are painted red,
    as TensorFlow's ``bad_color``."""
    if images.dtype == np.uint8:
        return images
    out = np.empty(images.shape, np.uint8)
    for i, image in enumerate(images.astype(np.float64)):
        finite = np.isfinite(image)
        values = image[finite]
        low = float(values.min()) if values.size else 0.0
        high = float(values.max()) if values.size else 0.0
        if low >= 0:
            scaled = image * (255.0 / high if high > 0 else 0.0)
        else:
            scaled = image * (127.0 / max(-low, high)) + 128.0
        scaled = np.clip(np.where(finite, scaled, 0.0), 0, 255).round()
        bad = ~finite.all(axis=-1)
        scaled[bad] = ([255.0, 0.0, 0.0, 255.0][: image.shape[-1]] if image.shape[-1] > 1
                       else 255.0)
        out[i] = scaled.astype(np.uint8)
    return out


def encode_png(image: np.ndarray) -> bytes:
    """One ``[height, width, channels]`` uint8 image as PNG (1, 3 or 4 channels)."""
    from PIL import Image

    mode = {1: "L", 3: "RGB", 4: "RGBA"}[image.shape[-1]]
    pixels = image[..., 0] if mode == "L" else image
    out = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels), mode=mode).save(out, format="PNG")
    return out.getvalue()


@kernel("ImageSummary", host_only=_HOST)
def _image(ctx: KernelContext):
    pb, tag, name = _pb(), ctx.attrs["tag"], ctx.name
    max_outputs = ctx.attrs["max_outputs"]

    def fn(x):
        x = to_host(x)
        if x.ndim != 4 or x.shape[-1] not in (1, 3, 4):
            raise InvalidArgumentError(
                f"op {name!r} (ImageSummary): tag {tag!r} needs images shaped "
                f"[batch, height, width, 1|3|4], got shape {x.shape}"
            )
        images = _to_uint8(x[:max_outputs])
        values = []
        for i, image in enumerate(images):
            # TF1's tags: "name/image" for one image, "name/image/i" for several.
            suffix = "/image" if max_outputs == 1 else f"/image/{i}"
            encoded = pb.Summary.Image(height=image.shape[0], width=image.shape[1],
                                       colorspace=image.shape[2],
                                       encoded_image_string=encode_png(image))
            values.append(pb.Summary.Value(tag=tag + suffix, image=encoded))
        return _as_bytes(pb.Summary(value=values))

    return fn


@kernel("TextSummary", host_only=_HOST)
def _text(ctx: KernelContext):
    pb, tag, name = _pb(), ctx.attrs["tag"], ctx.name
    from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2, types_pb2

    metadata = pb.SummaryMetadata(plugin_data=pb.SummaryMetadata.PluginData(plugin_name="text"))

    def fn(x):
        x = to_host(x)
        if x.dtype.kind not in "SUO":
            raise InvalidArgumentError(
                f"op {name!r} (TextSummary): tag {tag!r} needs strings, got {x.dtype}"
            )
        flat = [s.encode() if isinstance(s, str) else bytes(s) for s in x.ravel().tolist()]
        shape = tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=d) for d in x.shape])
        tensor = tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, tensor_shape=shape,
                                        string_val=flat)
        value = pb.Summary.Value(tag=tag, metadata=metadata, tensor=tensor)
        return _as_bytes(pb.Summary(value=[value]))

    return fn


@kernel("MergeSummary", host_only=_HOST)
def _merge(ctx: KernelContext):
    pb, name = _pb(), ctx.name

    def fn(*summaries):
        parts = [to_host(s).tobytes() for s in summaries]
        seen: set[str] = set()
        for part in parts:
            for value in pb.Summary.FromString(part).value:
                if value.tag in seen:
                    raise InvalidArgumentError(
                        f"op {name!r} (MergeSummary): duplicate tag {value.tag!r} in the "
                        "summaries merged"
                    )
                seen.add(value.tag)
        return np.frombuffer(b"".join(parts), np.uint8)

    return fn

