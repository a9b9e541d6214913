"""Optimizers: a user-level library over Variables, Assign* ops and math ops (paper section 4.1).

An optimizer only builds graph: slots are ordinary non-trainable Variables kept with their
variable, and every update is ops colocated with that variable. So whoever holds the
variable (one process, or a PS task receiving gradients from workers) applies the update,
and the runtime needs no notion of "optimizer" at all.

A dense update is one op per variable (``ResourceApplyAdam`` and its kin, as TensorFlow's
``training_ops``) that writes the variable and its slots in place: one kernel call, one
launch on a GPU, where the rule composed of elementwise ops is a dozen. Each rule is also
written here as ops on rows (``_sparse_rows``, for sparse gradients); the two are checked
against each other. Update rules follow TensorFlow 1.x's ``training_ops`` kernels term by
term, so results agree with ``tf.compat.v1.train.*Optimizer`` to rounding.

Sparse gradients (``IndexedSlices``, from ``Gather``) update only the rows that were looked
up. Rows looked up more than once are first summed, as TensorFlow does, so a repeated row
gets one update with the total gradient: ``unique`` gives the distinct rows and
``unsorted_segment_sum`` their summed gradients, values of the step, so concurrent updates
of one variable (async workers) share no scratch state; each distinct row is then written
once with ``scatter_update``. Adam's sparse update is the *lazy* rule (TensorFlow's
``LazyAdamOptimizer``): rows that were not looked up keep their moments, where dense Adam
would decay them.

The six optimizers of the paper share one base and are each a few dozen lines; they
stay in one file, as in TensorFlow 1.x's ``tf.train``, so their update rules read side
by side (the dense rules' arithmetic is in ``flowmill.kernels.training``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from flowmill.kernels import shapes

from . import dtypes, hooks
from .autodiff import IndexedSlices
from .backprop import gradients
from .graph import Graph, GraphKeys, Operation, Tensor, convert_to_tensor, get_default_graph
from .ops.array_ops import constant, gather, group, identity, unsorted_segment_sum, zeros_like
from .ops.math_ops import cast, rsqrt, size, sqrt, square
from .ops.state_ops import Variable, trainable_variables
from .ops.training_ops import apply_update
from .ops.unique_ops import unique

GLOBAL_STEP = GraphKeys.GLOBAL_STEP

Grad = Tensor | IndexedSlices
# Row rule of a sparse update: (var rows, summed grad rows, slot rows, hyper) ->
# (new var rows, new slot rows).
RowRule = Callable[[Tensor, Tensor, list[Tensor], dict], tuple[Tensor, list[Tensor]]]


# ---- the global step


def create_global_step(graph: Graph | None = None) -> Variable:
    """A non-trainable int64 counter of applied updates, registered in the graph."""
    graph = graph or get_default_graph()
    if get_global_step(graph) is not None:
        raise ValueError("this graph already has a global step")
    with graph.as_default(), graph.name_scope(None), graph.control_dependencies(None):
        step = Variable(0, trainable=False, name="global_step", dtype=dtypes.int64)
    graph.add_to_collection(GLOBAL_STEP, step)
    return step


def get_global_step(graph: Graph | None = None) -> Variable | None:
    found = (graph or get_default_graph()).get_collection(GLOBAL_STEP)
    return found[0] if found else None


def get_or_create_global_step(graph: Graph | None = None) -> Variable:
    return get_global_step(graph) or create_global_step(graph)


# ---- the base class


class Optimizer:
    """Computes gradients of a loss and applies them to variables, all as graph ops.

    Subclasses name their slots (``_slot_names``), build dense updates with in-place ops
    (``_apply_dense``) and sparse ones as a row rule (``_sparse_rows``).
    """

    _slot_names: tuple[str, ...] = ()

    def __init__(self, learning_rate, name: str):
        _check_hyper("learning_rate", learning_rate)
        self._learning_rate = learning_rate
        self._name = name
        self._slots: dict[str, dict[Variable, Variable]] = {}
        self._non_slots: dict[str, Variable] = {}

    @property
    def name(self) -> str:
        return self._name

    # ---- public API

    def compute_gradients(
        self, loss, var_list: Sequence[Variable] | None = None, gate_gradients: bool = True
    ) -> list[tuple[Grad | None, Variable]]:
        """(gradient, variable) pairs; the gradient is None where the loss does not depend on it.

        With ``gate_gradients`` every returned gradient is available only once all are
        computed. Updates are in place, so without the gate an update could overwrite a
        variable that the gradient of another variable still reads (``dx = dy @ W.T``).
        The gate costs nothing per step: it is control edges on inlined identities.
        """
        loss = convert_to_tensor(loss)
        if loss.dtype.kind != "f":
            raise TypeError(
                f"{self._name}: loss {loss.name} must be floating point, is {loss.dtype}"
            )
        if var_list is None:
            var_list = trainable_variables(loss.graph)
        var_list = list(var_list)
        if not var_list:
            raise ValueError(f"{self._name}: no variables to optimize (no trainable variables)")
        for v in var_list:
            if not isinstance(v, Variable):
                raise TypeError(f"{self._name}: var_list holds {v!r}, which is not a Variable")
        grads = gradients(loss, var_list)
        if gate_gradients:
            grads = _gate(loss.graph, grads)
        return list(zip(grads, var_list, strict=True))

    def apply_gradients(
        self, grads_and_vars, global_step: Variable | None = None, name: str | None = None
    ) -> Operation:
        """The op that applies every gradient once, then increments ``global_step``."""
        live: list[tuple[Grad, Variable]] = []
        seen: list[Variable] = []
        for g, v in grads_and_vars:
            if not isinstance(v, Variable):
                raise TypeError(f"{self._name}: {v!r} is not a Variable")
            seen.append(v)
            if g is None:
                continue
            if not isinstance(g, (Tensor, IndexedSlices)):
                g = convert_to_tensor(g, dtype=v.dtype)
            if g.dtype != v.dtype:
                raise TypeError(
                    f"{self._name}: gradient {g.name} of variable {v.name!r} has dtype "
                    f"{g.dtype}, the variable has {v.dtype}"
                )
            live.append((g, v))
        if not live:
            names = ", ".join(repr(v.name) for v in seen) or "none"
            raise ValueError(f"{self._name}: no gradients provided for any variable ({names})")
        graph = live[0][1].graph
        with graph.as_default():
            self._create_all_slots(graph, [v for _, v in live])
            with graph.name_scope(name or self._name):
                hyper_cache: dict[np.dtype, dict] = {}
                update_ops: list[Tensor | Operation] = []
                for g, v in live:
                    hyper = hyper_cache.get(v.dtype)
                    if hyper is None:
                        hyper = hyper_cache[v.dtype] = self._prepare(v.dtype)
                    with graph.name_scope("update_" + v.name), graph.colocate_with(v.handle):
                        if isinstance(g, IndexedSlices):
                            update_ops.append(self._apply_sparse(g, v, hyper))
                        else:
                            update_ops.append(self._apply_dense(g, v, hyper))
                if global_step is None:
                    return self._finish(update_ops, "apply")
                with graph.control_dependencies([self._finish(update_ops, "update")]):
                    with graph.colocate_with(global_step.handle):
                        return global_step.assign_add(1, name="increment_global_step").op

    def minimize(
        self,
        loss,
        global_step: Variable | None = None,
        var_list: Sequence[Variable] | None = None,
        gate_gradients: bool = True,
        name: str | None = None,
    ) -> Operation:
        """The train op: ``compute_gradients`` then ``apply_gradients``.

        In a worker of a distributed job (``FLOWMILL_CONFIG``) whose training mode is sync or
        bounded staleness, this builds that worker's replica of the mode over this optimizer
        instead, so the model script does not change."""
        train = None
        if hooks.replicated_minimize is not None:
            train = hooks.replicated_minimize(self, loss, global_step, var_list)
        if train is None:
            grads_and_vars = self.compute_gradients(loss, var_list, gate_gradients)
            if all(g is None for g, _ in grads_and_vars):
                names = ", ".join(repr(v.name) for _, v in grads_and_vars)
                raise ValueError(
                    f"{self._name}: loss {convert_to_tensor(loss).name} does not depend on "
                    f"any of the variables ({names})"
                )
            train = self.apply_gradients(grads_and_vars, global_step=global_step, name=name)
        train.graph.add_to_collection(GraphKeys.TRAIN_OP, train)
        return train

    def get_slot(self, var: Variable, name: str) -> Variable | None:
        """The slot ``name`` of ``var``; None for a variable this optimizer has not
        updated. A name that is none of this optimizer's slots is an error."""
        if name not in self._slot_names:
            raise ValueError(
                f"{self._name}: no slot named {name!r}; its slots are "
                f"{list(self._slot_names)}"
            )
        return self._slots.get(name, {}).get(var)

    def get_slot_names(self) -> list[str]:
        return sorted(self._slots)

    def variables(self) -> list[Variable]:
        """Every variable this optimizer made: slots and non-slot state (Adam's beta powers)."""
        out = [s for by_var in self._slots.values() for s in by_var.values()]
        return out + list(self._non_slots.values())

    # ---- slots

    def _slot_initial_value(self, slot: str, var: Variable):
        """A slot's starting value; zeros unless the rule says otherwise."""
        return 0.0

    def _create_all_slots(self, graph: Graph, var_list: list[Variable]) -> None:
        # Slots are state, not part of the step: no control deps or scopes of the caller.
        with graph.name_scope(None), graph.control_dependencies(None):
            for v in var_list:
                for slot in self._slot_names:
                    by_var = self._slots.setdefault(slot, {})
                    if v not in by_var:
                        by_var[v] = _make_slot(v, self._slot_initial_value(slot, v), self._name)
            self._create_non_slots(var_list)

    def _create_non_slots(self, var_list: list[Variable]) -> None:
        """State shared by all variables (e.g. Adam's beta powers); none by default."""

    def _non_slot(self, name: str, initial_value, colocate: Variable) -> Variable:
        var = self._non_slots.get(name)
        if var is None:
            with colocate.graph.colocate_with(colocate.handle):
                var = Variable(initial_value, trainable=False, name=name)
            self._non_slots[name] = var
        return var

    # ---- hooks

    def _prepare(self, dtype: np.dtype) -> dict:
        """Hyperparameters as tensors of ``dtype``, made once per apply and shared by all vars."""
        return {"lr": _hyper_tensor(self._learning_rate, dtype, "learning_rate")}

    def _apply_dense(self, grad: Tensor, var: Variable, hyper: dict):
        raise NotImplementedError(f"{type(self).__name__} has no dense update")

    def _sparse_rows(self, var_rows, grad_rows, slot_rows, hyper):
        raise NotImplementedError(f"{type(self).__name__} has no row-wise update")

    def _apply_sparse(self, grad: IndexedSlices, var: Variable, hyper: dict):
        """Row-wise update of the looked-up rows, repeated rows summed first (see module doc)."""
        slots = [self._slots[s][var] for s in self._slot_names]
        rows, where = unique(grad.indices)
        grad_rows = unsorted_segment_sum(grad.values, where, size(rows))
        var_rows = gather(var.read_value(), rows)
        old_rows = [gather(s.read_value(), rows) for s in slots]
        new_var_rows, new_slot_rows = self._sparse_rows(var_rows, grad_rows, old_rows, hyper)
        updates = [s.scatter_update(rows, r) for s, r in zip(slots, new_slot_rows, strict=True)]
        updates.append(var.scatter_update(rows, new_var_rows))
        return group(*updates)

    def _finish(self, update_ops: list, name: str) -> Operation:
        return group(*update_ops, name=name)


# ---- the optimizers


class GradientDescent(Optimizer):
    """var -= lr * grad."""

    def __init__(self, learning_rate, name: str = "GradientDescent"):
        super().__init__(learning_rate, name)

    def _apply_dense(self, grad, var, hyper):
        return apply_update("ResourceApplyGradientDescent", var, [], grad, [hyper["lr"]])

    def _apply_sparse(self, grad, var, hyper):
        # Linear in the gradient: repeated rows may simply each subtract their share.
        return var.scatter_sub(grad.indices, grad.values * hyper["lr"])


class Momentum(Optimizer):
    """accum = accum * momentum + grad; var -= lr * accum
    (Nesterov: var -= lr * grad + lr * momentum * accum)."""

    _slot_names = ("momentum",)

    def __init__(
        self,
        learning_rate,
        momentum,
        use_nesterov: bool = False,
        name: str = "Momentum",
        *,
        nesterov: bool | None = None,
    ):
        super().__init__(learning_rate, name)
        _check_hyper("momentum", momentum)
        if nesterov is not None:  # Keras' name
            use_nesterov = nesterov
        self._momentum = momentum
        self._nesterov = bool(use_nesterov)

    def _prepare(self, dtype):
        return {**super()._prepare(dtype), "m": _hyper_tensor(self._momentum, dtype, "momentum")}

    def _apply_dense(self, grad, var, hyper):
        return apply_update("ResourceApplyMomentum", var, [self._slots["momentum"][var]], grad,
                            [hyper["lr"], hyper["m"]], use_nesterov=self._nesterov)

    def _sparse_rows(self, var_rows, grad_rows, slot_rows, hyper):
        lr, m = hyper["lr"], hyper["m"]
        a = slot_rows[0] * m + grad_rows
        step = grad_rows * lr + a * m * lr if self._nesterov else a * lr
        return var_rows - step, [a]


class Adagrad(Optimizer):
    """accum += grad^2; var -= lr * grad / sqrt(accum)."""

    _slot_names = ("accumulator",)

    def __init__(
        self, learning_rate, initial_accumulator_value: float = 0.1, name: str = "Adagrad"
    ):
        super().__init__(learning_rate, name)
        if not initial_accumulator_value > 0:
            raise ValueError(
                f"{name}: initial_accumulator_value must be positive, "
                f"got {initial_accumulator_value}"
            )
        self._initial_accumulator = float(initial_accumulator_value)

    def _slot_initial_value(self, slot, var):
        return self._initial_accumulator

    def _apply_dense(self, grad, var, hyper):
        return apply_update("ResourceApplyAdagrad", var, [self._slots["accumulator"][var]],
                            grad, [hyper["lr"]])

    def _sparse_rows(self, var_rows, grad_rows, slot_rows, hyper):
        a = slot_rows[0] + square(grad_rows)
        return var_rows - grad_rows * hyper["lr"] * rsqrt(a), [a]


class Adadelta(Optimizer):
    """accum = rho * accum + (1 - rho) * grad^2;
    update = sqrt(accum_update + eps) / sqrt(accum + eps) * grad; var -= lr * update;
    accum_update = rho * accum_update + (1 - rho) * update^2."""

    _slot_names = ("accum", "accum_update")

    def __init__(
        self, learning_rate=0.001, rho=0.95, epsilon=1e-7, name: str = "Adadelta"
    ):
        super().__init__(learning_rate, name)
        _check_hyper("rho", rho, high=1.0, closed=True)
        _check_hyper("epsilon", epsilon, positive=True)
        self._rho, self._epsilon = rho, epsilon

    def _prepare(self, dtype):
        rho = _hyper_tensor(self._rho, dtype, "rho")
        return {
            **super()._prepare(dtype),
            "rho": rho,
            "one_minus_rho": 1.0 - rho,
            "eps": _hyper_tensor(self._epsilon, dtype, "epsilon"),
        }

    def _update(self, grad, accum, accum_update, hyper):
        """The rule on whole values or on rows: (var step, new accum, new accum_update)."""
        rho, one_minus, eps = hyper["rho"], hyper["one_minus_rho"], hyper["eps"]
        a = accum * rho + square(grad) * one_minus
        update = sqrt(accum_update + eps) * rsqrt(a + eps) * grad
        return update * hyper["lr"], a, accum_update * rho + square(update) * one_minus

    def _apply_dense(self, grad, var, hyper):
        slots = [self._slots["accum"][var], self._slots["accum_update"][var]]
        return apply_update("ResourceApplyAdadelta", var, slots, grad,
                            [hyper[k] for k in ("lr", "rho", "one_minus_rho", "eps")])

    def _sparse_rows(self, var_rows, grad_rows, slot_rows, hyper):
        step, a, au = self._update(grad_rows, slot_rows[0], slot_rows[1], hyper)
        return var_rows - step, [a, au]


class RMSProp(Optimizer):
    """ms = decay * ms + (1 - decay) * grad^2;
    mom = momentum * mom + lr * grad / sqrt(ms + eps); var -= mom.
    Centered: mg = decay * mg + (1 - decay) * grad, and the denominator is
    sqrt(ms - mg^2 + eps).

    As in TensorFlow 1.x, ``ms`` starts at ones. With a plain-number momentum of 0 there
    is no ``momentum`` slot: mom would always equal the current step.
    """

    def __init__(
        self,
        learning_rate,
        decay=0.9,
        momentum=0.0,
        epsilon=1e-10,
        centered: bool = False,
        name: str = "RMSProp",
        *,
        rho=None,
    ):
        super().__init__(learning_rate, name)
        if rho is not None:  # Keras' name for the decay
            decay = rho
        _check_hyper("decay", decay, high=1.0, closed=True)
        _check_hyper("momentum", momentum)
        _check_hyper("epsilon", epsilon, positive=True)
        self._decay, self._momentum, self._epsilon = decay, momentum, epsilon
        self._centered = bool(centered)
        self._use_momentum = isinstance(momentum, (Tensor, Variable)) or momentum != 0
        self._slot_names = (
            ("rms",)
            + (("momentum",) if self._use_momentum else ())
            + (("mg",) if self._centered else ())
        )

    def _slot_initial_value(self, slot, var):
        return 1.0 if slot == "rms" else 0.0

    def _prepare(self, dtype):
        decay = _hyper_tensor(self._decay, dtype, "decay")
        return {
            **super()._prepare(dtype),
            "one_minus_decay": 1.0 - decay,
            "momentum": _hyper_tensor(self._momentum, dtype, "momentum"),
            "eps": _hyper_tensor(self._epsilon, dtype, "epsilon"),
        }

    def _scaled_step(self, grad, ms, mg, hyper):
        denom = (ms - square(mg)) + hyper["eps"] if mg is not None else ms + hyper["eps"]
        return (grad * hyper["lr"]) * rsqrt(denom)

    def _apply_dense(self, grad, var, hyper):
        slots = [self._slots[s][var] for s in self._slot_names]
        return apply_update(
            "ResourceApplyRMSProp", var, slots, grad,
            [hyper[k] for k in ("lr", "one_minus_decay", "momentum", "eps")],
            centered=self._centered, use_momentum=self._use_momentum)

    def _sparse_rows(self, var_rows, grad_rows, slot_rows, hyper):
        one_minus = hyper["one_minus_decay"]
        rows = dict(zip(self._slot_names, slot_rows, strict=True))
        ms = rows["rms"] + (square(grad_rows) - rows["rms"]) * one_minus
        new = {"rms": ms}
        mg = None
        if self._centered:
            mg = new["mg"] = rows["mg"] + (grad_rows - rows["mg"]) * one_minus
        step = self._scaled_step(grad_rows, ms, mg, hyper)
        if self._use_momentum:
            step = new["momentum"] = rows["momentum"] * hyper["momentum"] + step
        return var_rows - step, [new[s] for s in self._slot_names]


class Adam(Optimizer):
    """lr_t = lr * sqrt(1 - beta2^t) / (1 - beta1^t); m += (grad - m) * (1 - beta1);
    v += (grad^2 - v) * (1 - beta2); var -= lr_t * m / (sqrt(v) + epsilon).

    beta1^t and beta2^t are variables (``beta1_power``, ``beta2_power``) kept with the
    first variable and advanced once per apply, after every update. Sparse gradients use
    the lazy rule (see the module doc).
    """

    _slot_names = ("m", "v")

    def __init__(
        self,
        learning_rate=0.001,
        beta1=0.9,
        beta2=0.999,
        epsilon=1e-8,
        name: str = "Adam",
        *,
        beta_1=None,
        beta_2=None,
    ):
        super().__init__(learning_rate, name)
        beta1 = beta1 if beta_1 is None else beta_1  # Keras' names
        beta2 = beta2 if beta_2 is None else beta_2
        _check_hyper("beta1", beta1, high=1.0)
        _check_hyper("beta2", beta2, high=1.0)
        _check_hyper("epsilon", epsilon, positive=True)
        self._beta1, self._beta2, self._epsilon = beta1, beta2, epsilon

    def _create_non_slots(self, var_list):
        first = min(var_list, key=lambda v: v.name)
        dtype = first.dtype if first.dtype.kind == "f" else dtypes.float32
        for key, beta in (("beta1_power", self._beta1), ("beta2_power", self._beta2)):
            if isinstance(beta, Tensor):
                value = cast(beta, dtype)
            else:
                value = constant(beta, dtype=dtype)
            self._non_slot(key, value, first)

    def _prepare(self, dtype):
        b1p = cast(self._non_slots["beta1_power"].value(), dtype)
        b2p = cast(self._non_slots["beta2_power"].value(), dtype)
        lr = _hyper_tensor(self._learning_rate, dtype, "learning_rate")
        beta1 = _hyper_tensor(self._beta1, dtype, "beta1")
        beta2 = _hyper_tensor(self._beta2, dtype, "beta2")
        return {
            "lr_t": lr * sqrt(1.0 - b2p) / (1.0 - b1p),
            "one_minus_beta1": 1.0 - beta1,
            "one_minus_beta2": 1.0 - beta2,
            "eps": _hyper_tensor(self._epsilon, dtype, "epsilon"),
        }

    def _apply_dense(self, grad, var, hyper):
        slots = [self._slots["m"][var], self._slots["v"][var]]
        return apply_update(
            "ResourceApplyAdam", var, slots, grad,
            [hyper[k] for k in ("lr_t", "one_minus_beta1", "one_minus_beta2", "eps")])

    def _sparse_rows(self, var_rows, grad_rows, slot_rows, hyper):
        m_rows, v_rows = slot_rows
        m = m_rows + (grad_rows - m_rows) * hyper["one_minus_beta1"]
        v = v_rows + (square(grad_rows) - v_rows) * hyper["one_minus_beta2"]
        return var_rows - (m * hyper["lr_t"]) / (sqrt(v) + hyper["eps"]), [m, v]

    def _finish(self, update_ops, name):
        b1p, b2p = self._non_slots["beta1_power"], self._non_slots["beta2_power"]
        graph = b1p.graph
        with graph.control_dependencies(update_ops), graph.colocate_with(b1p.handle):
            advanced = [
                b1p.assign(b1p.read_value() * cast(_raw(self._beta1, b1p.dtype), b1p.dtype)),
                b2p.assign(b2p.read_value() * cast(_raw(self._beta2, b2p.dtype), b2p.dtype)),
            ]
        return group(*update_ops, *advanced, name=name)


# ---- helpers


def _check_hyper(
    name: str, value, high: float | None = None, closed: bool = False, positive: bool = False
) -> None:
    """A plain-number hyperparameter in its range: at least 0 (above 0 with ``positive``),
    below ``high`` (at most, with ``closed``). A tensor is the script's to keep in range."""
    if isinstance(value, (Tensor, Variable)):
        return
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{name} must be a number or a Tensor, got {value!r}")
    if not np.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {'positive' if positive else 'non-negative'}, "
                         f"got {value}")
    if high is not None and (value > high or (value == high and not closed)):
        bound = f"[0, {high:g}]" if closed else f"[0, {high:g})"
        raise ValueError(f"{name} must be in {bound}, got {value}")


def _raw(value, dtype) -> Tensor:
    if isinstance(value, Variable):
        return value.value()
    if isinstance(value, Tensor):
        return value
    return constant(value, dtype=dtype)


def _hyper_tensor(value, dtype: np.dtype, name: str) -> Tensor:
    """A hyperparameter as a tensor of the variables' dtype (a Const, folded at compile)."""
    if isinstance(value, Variable):
        value = value.value()
    if isinstance(value, Tensor):
        if value.shape is not None and len(value.shape) != 0:
            raise ValueError(
                f"{name} must be a scalar, {value.name} has shape {shapes.fmt(value.shape)}"
            )
        return cast(value, dtype)
    return constant(value, dtype=dtype, name=name)


def _make_slot(var: Variable, fill: float, op_name: str) -> Variable:
    """A non-trainable Variable shaped like ``var``, named ``<var>/<op_name>``, kept with it."""
    graph = var.graph
    name = f"{var.name}/{op_name}"
    with graph.colocate_with(var.handle):
        if shapes.num_elements(var.shape) is not None:
            def init(shape, dtype):
                return constant(fill, dtype=dtype, shape=shape, name="initial_fill")

            return Variable(init, trainable=False, name=name, dtype=var.dtype, shape=var.shape)
        value = zeros_like(var.initial_value)
        if fill != 0:
            value = value + fill
        return Variable(value, trainable=False, name=name)




def _gate(graph: Graph, grads: list) -> list:
    """Identities of ``grads`` that each wait for every gradient (see compute_gradients)."""
    producers: list[Operation] = []
    for g in grads:
        if isinstance(g, IndexedSlices):
            producers += [g.values.op, g.indices.op]
        elif g is not None:
            producers.append(g.op)
    if len(producers) < 2:
        return grads
    out: list = []
    gate = graph.control_dependencies(producers)
    with graph.as_default(), graph.name_scope("gradients_gate"), gate:
        for g in grads:
            if isinstance(g, IndexedSlices):
                out.append(IndexedSlices(identity(g.values), identity(g.indices), g.dense_shape))
            elif g is None:
                out.append(None)
            else:
                out.append(identity(g))
    return out


__all__ = [
    "GLOBAL_STEP",
    "Adadelta",
    "Adagrad",
    "Adam",
    "GradientDescent",
    "Momentum",
    "Optimizer",
    "RMSProp",
    "create_global_step",
    "get_global_step",
    "get_or_create_global_step",
]
