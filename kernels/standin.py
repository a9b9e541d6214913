"""A strict GPU stand-in: an array module that behaves as CuPy does at the host/device boundary.

A GPU code path that passes a NumPy array to a device kernel, or hands a device array to
NumPy, fails on a real GPU and silently works on the CPU. This module is registered as the
``GPU`` device type where CuPy is absent (tests, ``FLOWMILL_STANDIN_GPUS=<n>``), so such a
path fails here the way it would there:

- its arrays are a type of their own (``ndarray``, computing with NumPy underneath);
- passing a NumPy array to one of its functions or operators raises ``TypeError``, and so
  does handing one of its arrays to NumPy (``np.asarray``, ``__array__``, the buffer
  protocol), with CuPy's messages;
- ``asarray``/``array`` of host data copies to the device, ``.get()``/``asnumpy`` back,
  ``.set()`` into a device array; each copy is counted (``counts()``), as is each implicit
  synchronization (``float(x)``, ``bool(x)``, ``x.item()``, ``x.tolist()``), so tests can
  assert how often a step crosses the boundary;
- names NumPy has and CuPy 14 lacks (``errstate``, object and string dtypes, ...) are
  missing here too;
- arrays live on a device (``cuda.Device(i)``); computing on arrays of another device
  than the current one raises ``ValueError`` as CuPy does;
- every call that computes counts as a kernel launch (views do not), and a function
  ``fuse``d counts one launch per call, as ``cupy.fuse`` compiles it into one kernel; what
  that kernel cannot hold is refused (``_Fusing``: one reduction at most, nothing but the
  reduced value after it, no ``keepdims``, indexing, shapes or arrays made inside);
- each device's memory pool has a limit (``set_limit``) and an allocation past it raises
  ``cuda.memory.OutOfMemoryError`` with CuPy's message;
- a stream captures as CUDA's do (``begin_capture``/``end_capture``, ``Graph.launch``):
  nothing runs while it captures, results hold garbage until a launch, a launch reruns
  the calls on the very arrays they were given, and copies or host synchronizations
  during capture raise.

It stands in for the boundary, not for CUDA: devices, streams, memory pools and pinned
memory are the small part of CuPy's API the runtime calls, with the semantics it relies on.

It is one file because its parts are one contract: the array type, the functions that
unwrap and wrap it, the launch and capture machinery every call goes through, and the
counters all read and write the same per-thread state; split, each part would import the
others' internals.
"""

from __future__ import annotations

import contextlib
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any

import numpy as _np

_lock = threading.Lock()
_counts = {"h2d": 0, "h2d_bytes": 0, "d2h": 0, "d2h_bytes": 0, "d2d": 0, "syncs": 0,
           "pinned": 0, "launches": 0}
_state = threading.local()  # the current device of each thread
DEVICE_COUNT = 1
DEVICE_MEMORY = 16 << 30  # bytes of each device, as ``cuda.runtime.memGetInfo`` reports them


def _count(kind: str, nbytes: int = 0) -> None:
    if kind in ("h2d", "d2h", "syncs") and getattr(_state, "capture", None) is not None:
        raise RuntimeError(
            "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is "
            f"capturing ({'a host synchronization' if kind == 'syncs' else 'a copy ' + kind})"
        )
    with _lock:
        _counts[kind] += 1
        if kind in ("h2d", "d2h"):
            _counts[kind + "_bytes"] += nbytes


def counts() -> dict[str, int]:
    """Copies and synchronizations since the last ``reset_counts``."""
    with _lock:
        return dict(_counts)


def reset_counts() -> None:
    with _lock:
        for k in _counts:
            _counts[k] = 0


def _current() -> int:
    return getattr(_state, "device", 0)


# Names NumPy 2 has and CuPy 14 does not (public, as found by comparing their namespaces).
_NOT_IN_CUPY = frozenset(
    "False_ ScalarType True_ asmatrix block bmat busday_count busday_offset busdaycalendar "
    "bytes_ char character clongdouble complex256 core ctypeslib datetime64 "
    "datetime_as_string datetime_data dtypes einsum_path emath errstate f2py flexible float128 "
    "frompyfunc fromregex geomspace get_include getbufsize geterr geterrcall "
    "histogram_bin_edges info insert is_busday isnat little_endian longdouble ma matrix "
    "matvec memmap nanpercentile nanquantile ndenumerate nditer nested_iters object_ polyder "
    "polydiv polyint rec recarray record sctypeDict setbufsize seterr seterrcall show_runtime "
    "spacing str_ strings test timedelta64 typecodes unstack vecdot vecmat void".split()
)
# ndarray members NumPy has and CuPy does not, or that would read device memory as host
# memory (``ctypes``, ``__array_interface__``).
_NOT_ON_CUPY_ARRAYS = frozenset(
    "__array_interface__ __array_struct__ __array_wrap__ ctypes getfield resize setfield "
    "setflags to_device data".split()
)
_IMPLICIT = (
    "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct "
    "a NumPy array explicitly."
)


class ndarray:  # noqa: N801 - named as CuPy's, which kernels test by name
    """A device array: a NumPy array reachable only through this module."""

    __slots__ = ("_a", "_device", "__weakref__")
    __array_ufunc__ = None  # NumPy ufuncs and operators refuse it, and defer to ours

    def __init__(self, shape=(), dtype=float, *, _array: _np.ndarray | None = None):
        self._a = _np.empty(shape, dtype) if _array is None else _array
        self._device = _current()

    # ---- what a device array refuses
    def __array__(self, *args, **kwargs):
        raise TypeError(_IMPLICIT)

    def __array_function__(self, func, types_, args, kwargs):
        """``np.f(device_array)`` runs this module's ``f``, as CuPy's does."""
        mine = getattr(_MODULE, func.__name__, None)
        if mine is None:
            return NotImplemented
        return mine(*args, **kwargs)

    def __getattr__(self, name: str):
        if name in _NOT_ON_CUPY_ARRAYS:
            raise AttributeError(f"'cupy.ndarray' object has no attribute {name!r}")
        attr = getattr(self._a, name)
        if callable(attr):
            _check_device(self._device)
            return _wrapped(attr, name, self._device, kind="method", this=self)
        trace = getattr(_state, "fusing", None)
        if trace is not None and name not in ("dtype", "ndim"):
            trace.refuse(f"`{name}` of an array is not known inside a fused kernel")
        return _wrap(attr, self._device)

    # ---- crossing the boundary, counted
    def get(self, stream=None, order="C", out=None, blocking=True) -> _np.ndarray:
        host = _np.array(self._a, order=order, copy=True)
        _count("d2h", host.nbytes)
        if out is not None:
            out[...] = host
            return out
        return host

    def set(self, arr: _np.ndarray, stream=None) -> None:
        if not isinstance(arr, _np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.shape != self._a.shape or arr.dtype != self._a.dtype:
            raise ValueError("Shape or dtype mismatch")
        _count("h2d", arr.nbytes)
        self._a[...] = arr

    def tobytes(self, order="C") -> bytes:
        _count("d2h", self._a.nbytes)
        return self._a.tobytes(order)

    @property
    def device(self) -> Device:
        return Device(self._device)

    # ---- plain array behaviour
    def __len__(self) -> int:
        return len(self._a)

    def __iter__(self):
        for row in self._a:
            yield _wrap(row, self._device)

    def __repr__(self) -> str:
        return f"standin.{self._a!r}"

    def __str__(self) -> str:
        return str(self._a)

    def __getitem__(self, key):
        trace = getattr(_state, "fusing", None)
        if trace is not None:
            trace.refuse("indexing is not supported in a fused kernel")
        key = _index(key, self._device)
        if not _advanced(key):  # a view: no kernel
            return _wrap(self._a[key], self._device)
        if any(getattr(k, "dtype", None) == _np.bool_ for k in
               (key if isinstance(key, tuple) else (key,))):
            _count("syncs")  # a mask's count of True values decides the size
        a = self._a
        return _launch(lambda: a[key], self._device)  # a gather

    def __setitem__(self, key, value) -> None:
        trace = getattr(_state, "fusing", None)
        if trace is not None and not (key is Ellipsis or key == slice(None)):
            trace.refuse("a fused kernel assigns only to `[...]` or `[:]`", ValueError)
        target, given = self, value
        key, value = _index(key, self._device), _unwrap(value, self._device)
        _traced("ufunc", "copy", (self, given), {},
                lambda: _launch(lambda: target._a.__setitem__(key, value), self._device,
                                target=target))

    def __copy__(self):
        a = self._a
        return _launch(lambda: a.copy(), self._device)

    def __reduce__(self):
        raise TypeError("a device array cannot be pickled; copy it to the host with .get()")


def _synchronizing(read: Callable):
    """A read of the values on the host (``float(x)``, ``x.item()``): a synchronization."""

    def method(self):
        if getattr(_state, "fusing", None) is not None:
            raise TypeError("Cannot convert to Python scalar in cupy.fuse")
        _count("syncs")
        return read(self._a)

    return method


for _name, _read in {
    "item": _np.ndarray.item, "tolist": _np.ndarray.tolist, "__float__": float,
    "__int__": int, "__bool__": bool, "__complex__": complex,
}.items():
    setattr(ndarray, _name, _synchronizing(_read))


def _binary(op: Callable, reflected: bool = False):
    def method(self, other):
        _check_device(self._device)
        a, b = self._a, _unwrap(other, self._device)
        return _traced("ufunc", op.__name__, (self, other), {}, lambda: _launch(
            (lambda: op(b, a)) if reflected else (lambda: op(a, b)), self._device))

    return method


def _inplace(op: Callable):
    def method(self, other):
        _check_device(self._device)
        a, b = self._a, _unwrap(other, self._device)
        return _traced("ufunc", op.__name__, (self, other), {},
                       lambda: _launch(lambda: op(a, b, out=a), self._device, target=self))

    return method


def _unary(op: Callable):
    def method(self):
        a = self._a
        return _traced("ufunc", op.__name__, (self,), {},
                       lambda: _launch(lambda: op(a), self._device))

    return method


# ---- kernel launches, and graph capture


def _launch(compute: Callable[[], Any], device: int | None, target: ndarray | None = None):
    """Run a kernel: ``compute()`` gives its NumPy result, or writes into ``target``.

    While a stream captures, nothing runs (as on CUDA): the call is recorded, to run at
    each launch of the graph on the arrays it was given (their buffers, as a captured
    kernel keeps its pointers), and a new result holds garbage until then."""
    if getattr(_state, "fused", False):  # inside a fused function, or a graph's launch
        out = compute()
        return target if target is not None else _wrap(out, device)
    capture = getattr(_state, "capture", None)
    if capture is None:
        _count("launches")
        out = compute()
        return target if target is not None else _wrap(out, device)
    if target is not None:
        capture.append(compute)
        return target
    result = _wrap(compute(), device)
    _fill(result, None)
    capture.append(lambda: _fill(result, compute()))
    return result


def _fill(result, value) -> None:
    """Write ``value`` into a captured result's buffers; None: garbage, as nothing ran."""
    if isinstance(result, ndarray):
        if value is not None:
            result._a[...] = value
        elif result._a.dtype.kind in "fc":
            result._a[...] = _np.nan
        else:  # zeros: garbage that is still a valid index for what runs on it meanwhile
            result._a[...] = 0
    elif isinstance(result, (tuple, list)):
        for i, r in enumerate(result):
            _fill(r, None if value is None else value[i])


class Graph:
    """A captured stream's work (``cupy.cuda.Graph``): ``launch`` runs it again, one launch."""

    def __init__(self, calls: list[Callable]):
        self._calls = calls

    def launch(self, stream: Stream | None = None) -> None:
        _count("launches")
        outer = getattr(_state, "fused", False)
        _state.fused = True
        try:
            for call in self._calls:
                call()
        finally:
            _state.fused = outer


for _name, _op in {
    "add": _np.add, "sub": _np.subtract, "mul": _np.multiply, "truediv": _np.true_divide,
    "floordiv": _np.floor_divide, "mod": _np.remainder, "pow": _np.power,
    "matmul": _np.matmul, "and": _np.bitwise_and, "or": _np.bitwise_or,
    "xor": _np.bitwise_xor, "lshift": _np.left_shift, "rshift": _np.right_shift,
}.items():
    setattr(ndarray, f"__{_name}__", _binary(_op))
    setattr(ndarray, f"__r{_name}__", _binary(_op, reflected=True))
    if _name != "matmul":
        setattr(ndarray, f"__i{_name}__", _inplace(_op))
for _name, _op in {
    "eq": _np.equal, "ne": _np.not_equal, "lt": _np.less, "le": _np.less_equal,
    "gt": _np.greater, "ge": _np.greater_equal,
}.items():
    setattr(ndarray, f"__{_name}__", _binary(_op))
for _name, _op in {
    "neg": _np.negative, "pos": _np.positive, "abs": _np.absolute, "invert": _np.invert,
}.items():
    setattr(ndarray, f"__{_name}__", _unary(_op))
ndarray.__hash__ = None  # type: ignore[assignment]


# ---- moving values between the host view and device arrays


def _check_device(device: int) -> None:
    if device != _current():
        raise ValueError(
            f"Array device must be same as the current device: array device = {device} "
            f"while current = {_current()}"
        )


def _unwrap(x, device: int | None = None):
    """A NumPy view of ``x`` for computing on it; host arrays are refused as CuPy does."""
    if isinstance(x, ndarray):
        _check_device(x._device)
        return x._a
    if isinstance(x, _np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v, device) for v in x)
    return x  # Python and NumPy scalars, None, slices, dtypes, strings


def _index(key, device: int):
    """An index: device arrays, and host index arrays (copied to the device, as CuPy does)."""
    if isinstance(key, tuple):
        return tuple(_index(k, device) for k in key)
    if isinstance(key, ndarray):
        return _unwrap(key, device)
    if isinstance(key, _np.ndarray):
        _count("h2d", key.nbytes)
        return key
    return key


def _advanced(key) -> bool:
    """Whether an index gathers (arrays, lists, booleans) rather than views."""
    keys = key if isinstance(key, tuple) else (key,)
    return any(isinstance(k, (_np.ndarray, list)) for k in keys)


def _wrap(x, device: int | None = None):
    """Device arrays for NumPy results (scalars too: CuPy reductions return 0-d arrays)."""
    if isinstance(x, _np.ndarray):
        out = ndarray.__new__(ndarray)
        out._a = x
        out._device = _current() if device is None else device
        if x.nbytes:
            root = x  # the memory a view of a new array (a kernel's reshaped result) holds
            while isinstance(root.base, _np.ndarray):
                root = root.base
            _POOL.track(root, out._device)
        return out
    if isinstance(x, _np.generic):
        return _wrap(_np.asarray(x), device)
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_wrap(v, device) for v in x)
    if isinstance(x, list):
        return [_wrap(v, device) for v in x]
    return x


# Calls that make a view or read metadata: no kernel runs.
_VIEWS = frozenset(
    "reshape transpose ravel squeeze expand_dims broadcast_to view swapaxes moveaxis "
    "result_type dtype shape ndim size can_cast promote_types finfo iinfo isscalar".split()
)


# Calls whose result's size depends on the values: CuPy reads a count back to the host.
_DATA_SIZED = frozenset("unique nonzero flatnonzero argwhere extract compress bincount".split())


def _wrapped(fn: Callable, name: str, device: int | None = None, kind: str = "function",
             this: ndarray | None = None) -> Callable:
    """``fn`` over device arrays; ``kind`` (``function``, ``method`` of ``this``, ``ufunc``
    or ``ufunc-method``) says what a fused function's trace takes it for."""
    launches = name not in _VIEWS
    syncs = name in _DATA_SIZED

    def run(args, kwargs):
        if syncs:
            _count("syncs")
        out = kwargs.get("out")
        args = _unwrap(args, device)
        kwargs = {k: _unwrap(v, device) for k, v in kwargs.items()}
        if not launches:
            return _wrap(fn(*args, **kwargs))
        target = out if isinstance(out, ndarray) else None
        return _launch(lambda: fn(*args, **kwargs), device, target)

    def call(*args, **kwargs):
        operands = args if this is None else (this, *args)
        return _traced(kind, name, operands + tuple(kwargs.values()), kwargs,
                       lambda: run(args, kwargs))

    call.__name__ = name
    return call


# ---- the module's functions


def asarray(a, dtype=None, order=None, *, blocking=False):
    if isinstance(a, ndarray):
        _check_device(a._device)
        return a if dtype is None or a._a.dtype == dtype else _wrap(a._a.astype(dtype))
    host = _np.asarray(a, dtype=dtype, order=order)
    _count("h2d", host.nbytes)
    return _wrap(_np.array(host, copy=True))  # device memory never aliases the host's


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        _check_device(obj._device)
        return _wrap(_np.array(obj._a, dtype=dtype, copy=copy, order=order, ndmin=ndmin))
    host = _np.array(obj, dtype=dtype, copy=True, order=order, ndmin=ndmin)
    _count("h2d", host.nbytes)
    return _wrap(host)


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Unsupported type {type(a)}")
    return _wrap(_np.ascontiguousarray(_unwrap(a), dtype=dtype))


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out)
    return _np.asarray(a, order=order)


def take(a, indices, axis=None, out=None):
    """CuPy's ``take``: out-of-range indices wrap around instead of raising (a bounds
    check would have to read the indices back to the host)."""
    a, indices = _unwrap(a), _unwrap(indices)
    return _wrap(_np.take(a, indices, axis=axis, out=_unwrap(out), mode="wrap"))


class _Generator:
    """``random.default_rng(seed)``: device arrays, and not NumPy's numbers for a seed (as
    CuPy's cuRAND streams are not), so no test can rely on the two agreeing."""

    def __init__(self, seed=None):
        seq = _np.random.SeedSequence(seed)
        self._rng = _np.random.default_rng(seq.spawn(1)[0])

    def __getattr__(self, name: str):
        return _wrapped(getattr(self._rng, name), name)


def fuse(*args, **kwargs):
    """``cupy.fuse``: the function's ufuncs and arithmetic as one kernel, one launch; what
    CuPy's kernel could not hold raises (``_Fusing``). Called inside another fused function
    it is part of that one's kernel, as CuPy inlines it. Called as CuPy's is: ``fuse(f)``
    fuses ``f``; with anything else (``fuse(kernel_name=...)``) it is a decorator, so
    ``fuse(f, kernel_name=...)`` returns a decorator too, not a fused ``f``."""
    if len(args) == 1 and not kwargs and callable(args[0]):
        return _fuse(args[0])
    return lambda f: _fuse(f, *args, **kwargs)


def _fuse(fn: Callable, kernel_name: str | None = None):
    name = kernel_name or getattr(fn, "__name__", "fused")

    def run(args):
        outer = getattr(_state, "fused", False)
        _state.fused = True
        _state.fusing = trace = _Fusing(name, args)
        try:
            result = fn(*args)
            trace.check_results(result)
            return _host_view(result)
        finally:
            _state.fused, _state.fusing = outer, None

    def fused(*args):
        if getattr(_state, "fusing", None) is not None:
            return fn(*args)
        capture = getattr(_state, "capture", None)
        if capture is not None and not getattr(_state, "fused", False):
            # Nothing runs under capture, and a fused function may write its arguments
            # in place: its result's shape comes from a run on copies, its values at launch.
            result = _wrap(run(tuple(_wrap(a._a.copy(), a._device) if isinstance(a, ndarray)
                                     else a for a in args)), None)
            _fill(result, None)
            capture.append(lambda: _fill(result, run(args)))
            return result
        return _launch(lambda: run(args), None)

    fused.__name__ = name
    return fused


# ---- what one fused kernel can hold

# Reductions a fused kernel can end its elementwise part with (functions, array methods).
_REDUCTIONS = frozenset("sum prod max min amax amin all any argmax argmin nansum nanprod".split())
# Calls that are elementwise besides the ufuncs and operators.
_ELEMENTWISE = frozenset("where clip astype copy".split())
# NumPy ufuncs that are no elementwise operation (nor are CuPy's counterparts).
_NOT_ELEMENTWISE = frozenset("matmul vecdot matvec vecmat".split())
# Calls that read metadata only.
_METADATA = frozenset("result_type can_cast promote_types finfo iinfo isscalar".split())


class _Fusing:
    """One call of a fused function, traced as ``cupy.fuse`` traces it into one kernel.

    CuPy compiles a fused function into one elementwise kernel or one reduction kernel:
    elementwise work on the inputs, then at most ONE reduction (``cupy.sum``/``max``/...,
    without ``keepdims``, which it refuses), then elementwise work on the reduced value
    alone. Its kernel has no indexing, no shapes, and no arrays but the inputs. What does
    not fit, CuPy 8 and later hand to an experimental second fusion (one cooperative
    launch with grid-wide syncs) instead of failing; the kernels here do not rely on that
    one, so the stand-in refuses what the first cannot compile, with CuPy's messages where
    it has them."""

    def __init__(self, name: str, args: tuple):
        self.name = name
        self.reduced = False
        self._after: dict[int, bool] = {}  # id of a traced array -> made after the reduction
        self._held: list[ndarray] = []  # keeps those ids from being reused during the call
        for a in args:
            self._add(a, False)

    def _add(self, x, after: bool) -> None:
        if isinstance(x, ndarray):
            self._after[id(x)] = after
            self._held.append(x)
        elif isinstance(x, tuple):
            for v in x:
                self._add(v, after)

    def refuse(self, what: str, error: type[Exception] = NotImplementedError):
        raise error(f"cupy.fuse {self.name!r}: {what}")

    def _phases(self, operands) -> set[bool]:
        """Whether each array operand was made after the reduction; arrays the trace does
        not know (made outside, or by a call that is no kernel's) are refused as CuPy does."""
        phases = set()
        for x in operands:
            if isinstance(x, ndarray):
                after = self._after.get(id(x))
                if after is None:
                    raise TypeError("Concrete ndarray is not supported in fusion.")
                phases.add(after)
        return phases

    def check(self, kind: str, name: str, operands: tuple, kwargs: dict) -> bool | None:
        """Whether the call's result comes after the reduction (None: no traced array, as
        for metadata), or an error where the kernel could not hold it."""
        base = name.rsplit(".", 1)[-1]
        arrays = any(isinstance(x, ndarray) for x in operands)
        if (kind in ("function", "method") and base in _REDUCTIONS) or (
                kind == "ufunc-method" and base == "reduce"):
            if kwargs.get("keepdims"):
                self.refuse(f"cupy.{base} does not support `keepdims` in fusion yet.")
            if self.reduced:
                self.refuse("Multiple reduction is not implemented yet (one fused kernel holds "
                            "one reduction: split the function)")
            self._phases(operands)
            self.reduced = True
            return True
        if (kind == "ufunc" and base not in _NOT_ELEMENTWISE) or (
                kind in ("function", "method") and base in _ELEMENTWISE):
            phases = self._phases(operands)
            if self.reduced and False in phases:
                self.refuse("after its reduction a fused kernel computes on the reduced value "
                            "alone, not on its inputs or what came before (CuPy: 'Shape "
                            "mismatch'); pass the reduced value to another fused function")
            return self.reduced
        if base in _METADATA or not arrays:
            return None  # metadata, or a new array the kernel cannot use (refused on use)
        self.refuse(f"{name} is no elementwise operation or reduction")

    def call(self, kind: str, name: str, operands: tuple, kwargs: dict, run: Callable):
        after = self.check(kind, name, operands, kwargs)
        result = run()
        if after is not None:
            self._add(result, after)
        return result

    def check_results(self, result) -> None:
        """A reduction kernel's outputs are of the reduced shape: values from before the
        reduction cannot be among them."""
        outputs = result if isinstance(result, tuple) else (result,)
        phases = self._phases(outputs)
        if self.reduced and False in phases:
            self.refuse("a fused kernel with a reduction returns only values computed after "
                        "it (CuPy: 'Shape mismatch')")


def _traced(kind: str, name: str, operands: tuple, kwargs: dict, run: Callable):
    """``run()``, checked first against the fused kernel being traced, if one is."""
    trace = getattr(_state, "fusing", None)
    if trace is None:
        return run()
    return trace.call(kind, name, operands, kwargs, run)


def _host_view(x):
    """The NumPy arrays behind a result of device arrays (for a fused function's)."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, tuple):
        return tuple(_host_view(v) for v in x)
    return x


def get_array_module(*args):
    return _MODULE if any(isinstance(a, ndarray) for a in args) else _np


class _Ufunc:
    """A NumPy ufunc over device arrays, with the methods CuPy's ufuncs have."""

    def __init__(self, ufunc: _np.ufunc):
        self._ufunc = ufunc
        self.__name__ = ufunc.__name__
        self.nin, self.nout = ufunc.nin, ufunc.nout

    def __call__(self, *args, **kwargs):
        return _wrapped(self._ufunc, self.__name__, kind="ufunc")(*args, **kwargs)

    def __getattr__(self, name: str):
        if name not in ("reduce", "accumulate", "at", "outer", "reduceat"):
            raise AttributeError(f"ufunc {self.__name__!r} has no attribute {name!r}")
        method = _wrapped(getattr(self._ufunc, name), f"{self.__name__}.{name}",
                          kind="ufunc-method")
        if name != "at":
            return method
        allowed = _AT_DTYPES.get(self.__name__)

        def at(a, *args, **kwargs):
            # CuPy's ufunc.at is a scatter kernel of its own, for a few ufuncs and dtypes.
            if allowed is None:
                raise NotImplementedError(f"cupy.{self.__name__}.at is not supported")
            if _np.dtype(a.dtype).name not in allowed:
                raise TypeError(f"cupy.{self.__name__}.at only supports "
                                f"{', '.join(sorted(allowed))} as data type")
            return method(a, *args, **kwargs)

        return at


# What CuPy's ``ufunc.at`` takes (its scatter kernels, ``_routines_indexing``; a later
# CuPy adds int64 to ``add``): ``subtract.at`` integers only.
_AT_DTYPES = {
    "add": {"int32", "uint32", "uint64", "float16", "float32", "float64"},
    "subtract": {"int32", "uint32"},
    "maximum": {"int32", "uint32", "uint64", "float32", "float64"},
    "minimum": {"int32", "uint32", "uint64", "float32", "float64"},
    "bitwise_and": {"int32", "int64", "uint32", "uint64"},
    "bitwise_or": {"int32", "int64", "uint32", "uint64"},
    "bitwise_xor": {"int32", "int64", "uint32", "uint64"},
}


class _Namespace(types.ModuleType):
    """NumPy's namespace seen through the device boundary (a submodule too)."""

    def __init__(self, name: str, host: types.ModuleType):
        super().__init__(name)
        self._host = host

    def __getattr__(self, name: str):
        if name.startswith("__") or name in _NOT_IN_CUPY:
            raise AttributeError(f"module 'cupy' has no attribute {name!r}")
        attr = getattr(self._host, name)
        if isinstance(attr, _np.ufunc):
            value: Any = _Ufunc(attr)
        elif isinstance(attr, types.ModuleType):
            value = _Namespace(f"{self.__name__}.{name}", attr)
        elif isinstance(attr, type) or not callable(attr):
            value = attr  # dtypes and scalar types, constants
        else:
            value = _wrapped(attr, name)
        setattr(self, name, value)
        return value


# ---- devices, streams, memory: the part of ``cupy.cuda`` the runtime uses


class Device:
    """``with Device(i):`` makes device ``i`` current for new arrays and kernels."""

    def __init__(self, device: int = 0):
        if not 0 <= int(device) < DEVICE_COUNT:
            raise RuntimeError(
                f"CUDARuntimeError: cudaErrorInvalidDevice: invalid device ordinal {device}"
            )
        self.id = int(device)
        self._outer: list[int] = []

    def use(self) -> None:
        _state.device = self.id

    def synchronize(self) -> None:
        pass

    def __enter__(self) -> Device:
        self._outer.append(_current())
        _state.device = self.id
        return self

    def __exit__(self, *exc) -> None:
        _state.device = self._outer.pop()

    def __eq__(self, other) -> bool:
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self) -> int:
        return self.id

    @property
    def mem_info(self) -> tuple[int, int]:
        with self:
            return _Runtime.memGetInfo()


class Stream:
    """A stream: work on it runs at once here, in order."""

    null: Stream

    def __init__(self, non_blocking: bool = False):
        self.non_blocking = non_blocking

    def synchronize(self) -> None:
        pass

    def begin_capture(self, mode=None) -> None:
        if getattr(_state, "capture", None) is not None:
            raise RuntimeError("cudaErrorIllegalState: the stream is capturing already")
        _state.capture = []

    def end_capture(self) -> Graph:
        calls, _state.capture = getattr(_state, "capture", None), None
        if calls is None:
            raise RuntimeError("cudaErrorIllegalState: the stream is not capturing")
        return Graph(calls)

    def is_capturing(self) -> bool:
        return getattr(_state, "capture", None) is not None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        pass


Stream.null = Stream()


class _Runtime:
    @staticmethod
    def getDeviceCount() -> int:  # noqa: N802 - CuPy's name
        return DEVICE_COUNT

    @staticmethod
    def memGetInfo() -> tuple[int, int]:  # noqa: N802 - CuPy's name
        """Free and total bytes of the current device."""
        return DEVICE_MEMORY - _POOL.used_bytes(), DEVICE_MEMORY


class OutOfMemoryError(MemoryError):
    """``cupy.cuda.memory.OutOfMemoryError``, with its message."""

    def __init__(self, size: int, total: int, limit: int = 0):
        self.size, self.total, self.limit = size, total, limit
        if limit == 0:
            msg = f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} bytes)."
        else:
            msg = (f"Out of memory allocating {size:,} bytes (allocated so far: {total:,} "
                   f"bytes, limit set to: {limit:,} bytes).")
        super().__init__(msg)

    def __reduce__(self):
        return (type(self), (self.size, self.total, self.limit))


class _MemoryPool:
    """CuPy's pool as its users see it, one per device (each call acts on the current
    device's, as CuPy's do): ``used_bytes`` of live device arrays, ``total_bytes`` held (a
    pool keeps what was freed: here the most ever used, until ``free_all_blocks``), and a
    limit (``set_limit``, 0: none). An array that would take the live bytes past the limit
    raises ``OutOfMemoryError``: CuPy counts the blocks it holds, but frees those it caches
    and tries again before it gives up, so live bytes are what decide."""

    def __init__(self):
        self._used: dict[int, int] = {}
        self._held: dict[int, int] = {}
        self._limit: dict[int, int] = {}
        self._blocks: dict[int, weakref.ref] = {}  # id -> each NumPy array counted, alive

    def track(self, block: _np.ndarray, device: int) -> None:
        """Count ``block`` (the NumPy array that owns a device array's memory) until it is
        freed, unless it is counted already."""
        with _lock:
            seen = self._blocks.get(id(block))
            if seen is not None and seen() is block:
                return
            nbytes = block.nbytes
            used, limit = self._used.get(device, 0), self._limit.get(device, 0)
            if limit and used + nbytes > limit:
                raise OutOfMemoryError(nbytes, used, limit)
            self._used[device] = used + nbytes
            self._held[device] = max(self._held.get(device, 0), used + nbytes)
            self._blocks[id(block)] = weakref.ref(block)
        weakref.finalize(block, self._free, id(block), nbytes, device)

    def _free(self, key: int, nbytes: int, device: int) -> None:
        with _lock:
            self._used[device] -= nbytes
            self._blocks.pop(key, None)

    def used_bytes(self) -> int:
        return self._used.get(_current(), 0)

    def total_bytes(self) -> int:
        return self._held.get(_current(), 0)

    def free_all_blocks(self) -> None:
        with _lock:
            self._held[_current()] = self._used.get(_current(), 0)

    def set_limit(self, size: int | None = None, fraction: float | None = None) -> None:
        """CuPy's: ``size`` bytes, or ``fraction`` of the device's memory; 0 or neither:
        no limit."""
        if size is None:
            if fraction is None:
                size = 0
            else:
                if not 0 <= fraction <= 1:
                    raise ValueError(f"memory limit fraction out of range: {fraction}")
                size = int(fraction * DEVICE_MEMORY)
        elif fraction is not None:
            raise ValueError("size and fraction cannot be specified at one time")
        if size < 0:
            raise ValueError(f"memory limit size out of range: {size}")
        with _lock:
            self._limit[_current()] = int(size)

    def get_limit(self) -> int:
        return self._limit.get(_current(), 0)


_POOL = _MemoryPool()
_PINNED_POOL = _MemoryPool()


def get_default_memory_pool() -> _MemoryPool:
    return _POOL


def get_default_pinned_memory_pool() -> _MemoryPool:
    return _PINNED_POOL


class _PrivatePool(_MemoryPool):
    """``cuda.MemoryPool()``: a pool of one's own (``malloc`` for ``using_allocator``)."""

    def malloc(self, nbytes: int):
        return None


@contextlib.contextmanager
def _using_allocator(allocator=None):
    yield


cuda = types.SimpleNamespace(
    Device=Device,
    Stream=Stream,
    Graph=Graph,
    MemoryPool=_PrivatePool,
    using_allocator=_using_allocator,
    runtime=_Runtime(),
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
    get_current_stream=lambda: Stream.null,
)


def empty_pinned(shape, dtype=float, order="C") -> _np.ndarray:
    """Host memory a device copies from asynchronously (cupyx.empty_pinned), counted."""
    _count("pinned")
    return _np.empty(shape, dtype, order)


_OWN = {
    "ndarray": ndarray,
    "asarray": asarray,
    "array": array,
    "ascontiguousarray": ascontiguousarray,
    "asnumpy": asnumpy,
    "take": take,
    "get_array_module": get_array_module,
    "cuda": cuda,
    "get_default_memory_pool": get_default_memory_pool,
    "get_default_pinned_memory_pool": get_default_pinned_memory_pool,
    "empty_pinned": empty_pinned,
    "fuse": fuse,
}
_MODULE = _Namespace("cupy", _np)
_MODULE.__dict__.update(_OWN)
_MODULE.random = _Namespace("cupy.random", _np.random)
_MODULE.random.default_rng = _Generator


def report_at_exit(directory: str) -> None:
    """Write this process's counts to ``<directory>/<pid>.json`` when it exits (with its
    command line), for tests that run tasks as processes."""
    import atexit
    import json
    import os
    import sys

    def write() -> None:
        path = os.path.join(directory, f"{os.getpid()}.json")
        with open(path, "w") as f:
            json.dump({"argv": sys.argv, "counts": counts()}, f)

    atexit.register(write)


def module(devices: int = 1) -> types.ModuleType:
    """The stand-in array module, with ``devices`` GPUs and no memory limits."""
    global DEVICE_COUNT
    if devices < 1:
        raise ValueError(f"a GPU stand-in needs at least one device, got {devices}")
    DEVICE_COUNT = int(devices)
    with _lock:
        _POOL._limit.clear()
    return _MODULE
