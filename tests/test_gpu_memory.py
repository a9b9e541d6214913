"""How much of each GPU a process may use (``runtime/gpu_memory.py``): the session's
``ConfigProto(gpu_options=GPUOptions(per_process_gpu_memory_fraction=...))`` or
``FLOWMILL_GPU_MEMORY_FRACTION`` limits CuPy's memory pool on every GPU of the task, and a
step that needs more fails naming its op, the device and the limit. On the stand-in, whose
devices are made small here so that a small step fills them."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import flowmill.runtime as fm
from flowmill.kernels import ARRAY_MODULES, memory_limit, standin
from flowmill.runtime import gpu_memory

DEVICE = 64 << 10  # bytes of each stand-in device in these tests


@pytest.fixture
def small_gpus(standin_gpu, monkeypatch):
    """The stand-in with two GPUs of ``DEVICE`` bytes; no fraction from the environment,
    and no limit left behind."""
    if standin_gpu.counts() is None:
        pytest.skip("the limits are checked on the stand-in's small devices")
    monkeypatch.setattr(standin, "DEVICE_MEMORY", DEVICE)
    monkeypatch.delenv(gpu_memory.ENV, raising=False)
    monkeypatch.setattr(gpu_memory, "_applied", None)
    yield standin_gpu
    xp = ARRAY_MODULES["GPU"]
    for i in range(2):
        with xp.cuda.Device(i):
            xp.get_default_memory_pool().set_limit(size=0)


def _config(fraction) -> fm.ConfigProto:
    return fm.ConfigProto(gpu_options=fm.GPUOptions(per_process_gpu_memory_fraction=fraction,
                                                    allow_growth=True))


def _limits() -> list[int]:
    return [memory_limit("GPU", i) for i in range(2)]


def test_the_session_option_limits_every_gpu_of_the_task(small_gpus):
    assert _limits() == [0, 0]
    fm.Session(fm.Graph(), config=_config(0.25)).close()
    assert _limits() == [DEVICE // 4] * 2


def test_the_environment_sets_the_fraction_and_the_session_option_overrides_it(small_gpus,
                                                                              monkeypatch):
    monkeypatch.setenv(gpu_memory.ENV, "0.5")
    fm.Session(fm.Graph()).close()
    assert _limits() == [DEVICE // 2] * 2
    fm.Session(fm.Graph(), config=_config(0.25)).close()
    assert _limits() == [DEVICE // 4] * 2


def test_a_step_past_the_limit_fails_naming_its_op_the_device_and_the_limit(small_gpus):
    graph = fm.Graph()
    with graph.as_default():
        x = fm.placeholder(fm.float32, [1024])  # 4 KiB
        with fm.device("/gpu:1"):
            big = fm.tile(x, [8], name="big")  # 32 KiB, past a quarter of 64 KiB
            small = fm.multiply(x, 2.0, name="small")
    value = np.ones(1024, np.float32)
    with fm.Session(graph, config=_config(0.25)) as sess:
        np.testing.assert_array_equal(sess.run(small, {x: value}), value * 2)
        with pytest.raises(fm.ResourceExhaustedError) as e:
            sess.run(big, {x: value})
    message = str(e.value)
    assert "op 'big' (Tile) on GPU:1 ran out of memory" in message
    assert re.search(r"Out of memory allocating 32,768 bytes \(allocated so far: [\d,]+ "
                     r"bytes, limit set to: 16,384 bytes\)\.", message)
    assert "per_process_gpu_memory_fraction=0.25, from GPUOptions" in message
    assert gpu_memory.ENV in message
    assert isinstance(e.value, MemoryError)


@pytest.mark.parametrize("bad", [0, 0.0, 1.5, -0.1, math.nan, True, "0.4", None])
def test_a_session_option_that_is_no_fraction_is_refused(small_gpus, bad):
    if bad is None:  # no option: nothing to refuse, and no limit
        fm.Session(fm.Graph(), config=_config(bad)).close()
        assert _limits() == [0, 0]
        return
    with pytest.raises(ValueError, match="GPUOptions.per_process_gpu_memory_fraction must be "
                                         r"a fraction of each GPU's memory in \(0, 1\]"):
        fm.Session(fm.Graph(), config=_config(bad))
    assert _limits() == [0, 0]


@pytest.mark.parametrize("bad", ["0", "1.01", "forty percent", "nan", "-1"])
def test_an_environment_value_that_is_no_fraction_is_refused(small_gpus, monkeypatch, bad):
    monkeypatch.setenv(gpu_memory.ENV, bad)
    with pytest.raises(ValueError, match=f"{gpu_memory.ENV} \\(per_process_gpu_memory_fraction"
                                         r"\) must be a fraction"):
        fm.Session(fm.Graph())


def test_the_stand_ins_pool_raises_cupys_error_past_its_limit(small_gpus):
    xp = ARRAY_MODULES["GPU"]
    with xp.cuda.Device(1):
        pool = xp.get_default_memory_pool()
        before = pool.used_bytes()  # what earlier tests' arrays still hold
        pool.set_limit(size=before + 4096)
        assert pool.get_limit() == before + 4096
        kept = xp.zeros(512, np.float32)  # 2 KiB
        with pytest.raises(xp.cuda.memory.OutOfMemoryError) as e:
            xp.zeros(1024, np.float32)
        assert str(e.value) == (f"Out of memory allocating 4,096 bytes (allocated so far: "
                                f"{before + 2048:,} bytes, limit set to: {before + 4096:,} "
                                "bytes).")
        del kept
        xp.zeros(1024, np.float32)  # what was freed counts no more
        with pytest.raises(ValueError, match="memory limit fraction out of range"):
            pool.set_limit(fraction=1.5)
    with xp.cuda.Device(0):  # the other device's pool has no limit
        assert xp.get_default_memory_pool().get_limit() == 0
        xp.zeros(4096, np.float32)
