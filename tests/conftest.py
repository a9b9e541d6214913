import os
import pathlib
import sys
import tempfile

import pytest

# Test helpers (opcheck) live beside the tests.
sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture(autouse=True, scope="session")
def _summaries_outside_the_repository():
    """Local runs write summaries (and a loss plot) to ``logs/<job>`` where they run, the
    repository for most tests here: a session-wide directory of its own instead."""
    with tempfile.TemporaryDirectory(prefix="flowmill-test-logs-") as d:
        saved = os.environ.get("FLOWMILL_SUMMARY_URI")
        os.environ["FLOWMILL_SUMMARY_URI"] = d
        yield d
        if saved is None:
            os.environ.pop("FLOWMILL_SUMMARY_URI", None)
        else:
            os.environ["FLOWMILL_SUMMARY_URI"] = saved


@pytest.fixture
def servers():
    """Starts task servers in this process (``servers(spec, role, index)``); all are
    stopped after the test."""
    from flowmill.runtime.cluster import TaskConfig
    from flowmill.runtime.server import Server

    started: list[Server] = []

    def start(spec, role: str, index: int) -> Server:
        started.append(Server(TaskConfig(spec, role, index)))
        return started[-1]

    yield start
    for s in started:
        s.stop()


class _RealGPU:
    """What a test reads of the stand-in, on a real GPU: no counts."""

    @staticmethod
    def counts():
        return None

    @staticmethod
    def reset_counts():
        pass


@pytest.fixture
def standin_gpu():
    """The strict GPU stand-in (``flowmill.kernels.standin``) as this process's ``GPU``
    device type, with 2 devices, for one test; counts reset. Where a real GPU module is
    registered it is put back afterwards. With ``FLOWMILL_TEST_GPU=cupy`` (the GPU check)
    a test taking it runs on the real GPU instead, and counts nothing."""
    from flowmill.kernels import ARRAY_MODULES, add_array_module, remove_array_module, standin
    from flowmill.runtime import local_devices

    if os.environ.get("FLOWMILL_TEST_GPU") == "cupy":
        if local_devices.gpu_count() == 0:
            pytest.skip("FLOWMILL_TEST_GPU=cupy, and CuPy finds no GPU")
        yield _RealGPU
        return
    real = ARRAY_MODULES.get("GPU")
    saved = os.environ.pop(local_devices.GPUS_ENV, None)
    if real is not None:
        remove_array_module("GPU")
    add_array_module("GPU", standin.module(2))
    local_devices.gpu_count.cache_clear()
    standin.reset_counts()
    try:
        yield standin
    finally:
        remove_array_module("GPU")
        if real is not None:
            add_array_module("GPU", real)
        if saved is not None:
            os.environ[local_devices.GPUS_ENV] = saved
        local_devices.gpu_count.cache_clear()
