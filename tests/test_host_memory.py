"""Host memory reuse (``kernels.host_memory``): a process that imports the kernels keeps
the large blocks it frees, so a step's temporaries do not fault in fresh pages each step."""

import os
import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent(
    """
    import resource, sys
    import numpy as np
    from flowmill.kernels import host_memory
    print(host_memory.keep_freed_memory())
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):  # a step's pattern: large temporaries of several sizes, then freed
        before = faults()
        arrays = [np.ones((n, 1024), np.float32) for n in (2048, 3072, 1536, 4096)]
        del arrays
    print(faults() - before)
    """
)


def _probe(**env) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env={**os.environ, **env}, capture_output=True,
        text=True, check=True, cwd="/",
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_are_reused_without_fresh_pages():
    applied, faults = _probe()
    assert applied == "True"
    # 40 MiB allocated in the last round: 10,240 pages if they came fresh from the kernel.
    assert faults < 500, faults


def test_the_system_allocator_can_be_kept():
    applied, _ = _probe(FLOWMILL_MALLOC="system")
    assert applied == "False"
