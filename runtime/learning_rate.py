"""Learning-rate schedules on the global step (TensorFlow 1.x's ``learning_rate_decay``).

Each returns a scalar tensor computed from the step each time it is run, so passing it
as an optimizer's ``learning_rate`` makes every update read the rate of its own step:
the schedule is graph, like everything else, and works unchanged in a distributed job,
where the global step lives on a PS task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .graph import Tensor, convert_to_tensor, get_default_graph
from .ops.math_ops import cast, floordiv, less_equal, minimum, pow
from .ops.select_ops import where
from .ops.unary_math_ops import cos


def _rate(learning_rate) -> Tensor:
    rate = convert_to_tensor(learning_rate)
    if rate.dtype.kind != "f":
        raise TypeError(f"learning_rate must be floating point, {rate.name} is {rate.dtype}")
    if rate.shape is not None and rate.shape != ():
        raise ValueError(f"learning_rate must be a scalar, {rate.name} has shape {rate.shape}")
    return rate


def _step(global_step, what: str) -> Tensor:
    if global_step is None:
        raise ValueError(f"{what}: global_step is required")
    step = convert_to_tensor(global_step)
    if step.shape is not None and step.shape != ():
        raise ValueError(f"{what}: global_step must be a scalar, {step.name} has {step.shape}")
    return step


def _positive(value, what: str):
    if not isinstance(value, Tensor) and not hasattr(value, "_as_graph_element"):
        if not value > 0:
            raise ValueError(f"{what} must be positive, got {value!r}")
    return value


def exponential_decay(
    learning_rate, global_step, decay_steps, decay_rate, staircase: bool = False, name=None
) -> Tensor:
    """``learning_rate * decay_rate ** (global_step / decay_steps)``; with ``staircase``
    the exponent is floored, so the rate drops every ``decay_steps`` steps."""
    step = _step(global_step, "exponential_decay")
    _positive(decay_steps, "exponential_decay: decay_steps")
    with get_default_graph().name_scope(name or "ExponentialDecay"):
        rate = _rate(learning_rate)
        p = cast(step, rate.dtype) / cast(convert_to_tensor(decay_steps), rate.dtype)
        if staircase:
            p = floordiv(p, 1.0)
        base = cast(convert_to_tensor(decay_rate), rate.dtype)
        return rate * pow(base, p)


def piecewise_constant(x, boundaries: Sequence, values: Sequence, name=None) -> Tensor:
    """``values[0]`` while ``x <= boundaries[0]``, ``values[i]`` while ``boundaries[i - 1]
    < x <= boundaries[i]``, and ``values[-1]`` past the last boundary."""
    if len(values) != len(boundaries) + 1:
        raise ValueError(
            f"piecewise_constant: {len(values)} values for {len(boundaries)} boundaries; "
            "there must be one value more than boundaries"
        )
    x = _step(x, "piecewise_constant")
    plain = [b for b in boundaries if not isinstance(b, Tensor)]
    if any(a >= b for a, b in zip(plain, plain[1:], strict=False)):
        raise ValueError(f"piecewise_constant: boundaries {list(boundaries)} must increase")
    with get_default_graph().name_scope(name or "PiecewiseConstant"):
        first = convert_to_tensor(values[0])
        rates = [first] + [convert_to_tensor(v, dtype=first.dtype) for v in values[1:]]
        result = rates[-1]
        for bound, rate in zip(reversed(boundaries), reversed(rates[:-1]), strict=True):
            result = where(less_equal(x, convert_to_tensor(bound, dtype=x.dtype)), rate, result)
        return result


def cosine_decay(learning_rate, global_step, decay_steps, alpha: float = 0.0, name=None) -> Tensor:
    """Half a cosine from ``learning_rate`` down to ``alpha * learning_rate`` over
    ``decay_steps`` steps, then flat (Loshchilov and Hutter, 2017, without restarts)."""
    step = _step(global_step, "cosine_decay")
    _positive(decay_steps, "cosine_decay: decay_steps")
    with get_default_graph().name_scope(name or "CosineDecay"):
        rate = _rate(learning_rate)
        steps = cast(convert_to_tensor(decay_steps), rate.dtype)
        done = minimum(cast(step, rate.dtype), steps) / steps
        cosine = 0.5 * (1.0 + cos(done * math.pi))
        return rate * ((1.0 - alpha) * cosine + alpha)


__all__ = ["cosine_decay", "exponential_decay", "piecewise_constant"]
