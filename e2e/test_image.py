"""The project's images, built here from the Dockerfile (``e2e/image.sh``), run locked down.

Every container runs as a restricted pod would: read-only root filesystem, no capabilities,
no privilege gain, as 65532:65532 (given with ``--user``; it is also the images' USER), and
without a network (``--network=none``: a network namespace of its own with only loopback,
where the digits job's tasks talk). One tmpfs is writable, ``/tmp``: the launcher's
mutual-TLS certificates and progress files (``tempfile``), the job's summaries
(``FLOWMILL_SUMMARY_URI``, not ``logs/`` in the read-only working directory) and CuPy's
kernel cache (``CUPY_CACHE_DIR``) go there. podman's implicit tmpfs on /run and /var/tmp
is turned off (``--read-only-tmpfs=false``): nothing needs them.

The images are built before the first test (``conftest.py``) unless
``FLOWMILL_IMAGE_BUILD=0``; without them the tests fail, saying how to build them.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .images import IMAGE_BUILD_ERROR, IMAGE_SCRIPT, Image, inspect, podman_env
from .versions import cache_dir

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.image,
    pytest.mark.skipif(sys.platform != "linux", reason="podman runs containers on Linux only"),
]

UID = "65532"
LOCKED_DOWN = [
    "--read-only", "--read-only-tmpfs=false",  # no implicit tmpfs on /run, /var/tmp
    "--tmpfs=/tmp:rw,nosuid,nodev,size=256m,mode=1777",
    "--cap-drop=ALL", "--security-opt=no-new-privileges", "--network=none",
]
# Budgets that catch a CUDA library or a dependency too many (2026-12: 782 MB, 2345 MB;
# the whole CUDA toolkit of `cupy-cuda12x[ctk]` would add about 1 GB).
MAX_MB = {"cpu": 1200, "cuda": 3000}


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest) -> dict[str, str]:
    error = request.config.stash.get(IMAGE_BUILD_ERROR, None)
    if error is not None:
        pytest.fail(f"the images could not be built:\n{error}")
    return podman_env()


@pytest.fixture(scope="module")
def images(env: dict[str, str]) -> dict[str, Image]:
    found = {t: inspect(t, env) for t in ("cpu", "cuda")}
    missing = [t for t, image in found.items() if image is None]
    if missing:
        pytest.fail(f"images not built for the current sources: {missing} "
                    f"(run {IMAGE_SCRIPT.relative_to(IMAGE_SCRIPT.parents[1])}, or unset "
                    "FLOWMILL_IMAGE_BUILD=0)")
    return found  # type: ignore[return-value]


def run(env: dict[str, str], image: Image, *argv: str, extra: tuple[str, ...] = (),
        user: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``argv`` in a locked-down container of ``image``, as 65532:65532 unless ``user`` is
    False (then as the image's USER)."""
    who = [f"--user={UID}:{UID}"] if user else []
    return subprocess.run(
        ["podman", "run", "--rm", *LOCKED_DOWN, *who, *extra, image.ref, *argv],
        capture_output=True, text=True, env=env, timeout=timeout)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_image_runs_as_65532_in_home_with_the_examples(env: dict[str, str],
                                                        images: dict[str, Image],
                                                        target: str) -> None:
    out = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Config.User}} {{.Config.WorkingDir}}",
         images[target].ref], capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.split() == [f"{UID}:{UID}", "/home/flowmill"]
    # Run with the image's own user (no --user): the examples are there, and not writable.
    ls = run(env, images[target], "sh", "-c",
             "id -u && ls examples && test ! -w examples && echo read-only", user=False)
    assert ls.returncode == 0, ls.stderr
    lines = ls.stdout.split()
    assert lines[0] == UID and "digits.yaml" in lines and lines[-1] == "read-only"


def test_cpu_image_flowmill_help(env: dict[str, str], images: dict[str, Image]) -> None:
    out = run(env, images["cpu"], "flowmill", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: flowmill"), out.stdout


def test_cpu_image_trains_digits(env: dict[str, str], images: dict[str, Image]) -> None:
    """`flowmill run examples/digits.yaml --local` in the image: 2 ps and 2 workers on the
    container's loopback, mutual TLS, to worker 0's test accuracy."""
    out = run(env, images["cpu"], "sh", "-c",
              "id -u && id -g && exec flowmill run examples/digits.yaml --local",
              extra=("--env=FLOWMILL_SUMMARY_URI=/tmp/summaries",), timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.splitlines()[:2] == [UID, UID]
    match = re.search(r"^\[worker-0\] test_accuracy: (\d\.\d{4})$", out.stdout, re.M)
    assert match, out.stdout[-3000:]
    assert float(match.group(1)) >= 0.95
    # The launcher's own lines and the servers' logs go to stderr.
    assert "flowmill: job digits succeeded" in out.stderr, out.stderr[-3000:]
    assert "tasks talk over mutual TLS" in out.stderr


def test_cuda_image_imports_flowmill_with_cupy(env: dict[str, str],
                                               images: dict[str, Image],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """CuPy imports without a GPU (none is here, nor a driver), registers the GPU kernels,
    and finds the CUDA runtime libraries in the image's wheels; asking for devices is a
    CUDA error, not a crash."""
    check = (
        "import cupy, flowmill.runtime\n"
        "from flowmill.kernels import ARRAY_MODULES\n"
        "from cuda.pathfinder import load_nvidia_dynamic_lib\n"
        "print('cupy', cupy.__version__, 'GPU' in ARRAY_MODULES)\n"
        "print('cuda runtime', cupy.cuda.runtime.runtimeGetVersion())\n"
        "for lib in ('cudart', 'nvrtc', 'cublas', 'cublasLt', 'curand'):\n"
        "    print(lib, load_nvidia_dynamic_lib(lib).abs_path)\n"
        "try:\n"
        "    print('devices', cupy.cuda.runtime.getDeviceCount())\n"
        "except cupy.cuda.runtime.CUDARuntimeError as e:\n"
        "    print('getDeviceCount:', e)\n"
    )
    out = run(env, images["cuda"], "python", "-c", check)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert re.fullmatch(r"cupy 1\d\.\d+\.\d+ True", lines[0]), lines
    assert re.fullmatch(r"cuda runtime 12\d{3}", lines[1]), lines
    for line in lines[2:7]:
        assert "/opt/flowmill/lib/python3" in line and "/site-packages/nvidia/" in line, line
    assert lines[7].startswith("getDeviceCount: cuda"), lines[7]  # no driver in the container
    with capsys.disabled():
        print(f"\n  cuda image: {lines[0]}, {lines[1]}; {lines[7]}")


def test_cuda_image_compiles_a_kernel_without_a_device(env: dict[str, str],
                                                       images: dict[str, Image]) -> None:
    """NVRTC compiles, with no GPU, a kernel that includes CuPy's headers and CUDA's
    float16 one: the headers CuPy's elementwise kernels need are in the image (CUDA's from
    the runtime wheel)."""
    check = (
        "import os, cupy\n"
        "from cupy.cuda import nvrtc\n"
        "site = os.path.dirname(os.path.dirname(cupy.__file__))\n"
        "inc = f'{site}/cupy/_core/include'\n"
        "opts = [f'-I{inc}', f'-I{site}/nvidia/cuda_runtime/include', '--std=c++17',\n"
        "        '-arch=compute_80']\n"
        "opts += [f'-I{inc}/cupy/_cccl/{d}' for d in ('libcudacxx', 'thrust', 'cub')]\n"
        "src = '''#include <cupy/complex.cuh>\n#include <cuda_fp16.h>\n"
        "extern \"C\" __global__ void twice(float* y, const float* x) {\n"
        "  y[threadIdx.x] = __half2float(__float2half(2.0f)) * x[threadIdx.x]; }\n'''\n"
        "p = nvrtc.createProgram(src, 'twice.cu', (), ())\n"
        "try:\n"
        "    nvrtc.compileProgram(p, opts)\n"
        "except nvrtc.NVRTCError:\n"
        "    raise SystemExit(nvrtc.getProgramLog(p))\n"
        "print('.entry twice' in nvrtc.getPTX(p).decode())\n"
    )
    out = run(env, images["cuda"], "python", "-c", check)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip() == "True"


def test_image_sizes(images: dict[str, Image], capsys: pytest.CaptureFixture[str]) -> None:
    """Both images' sizes (and build times, when the script built them) are printed and
    appended to the cache's build-logs/summary.tsv."""
    def mb(image: Image) -> int:
        return image.size_bytes // 1_000_000

    def built(image: Image) -> str:
        return "?" if image.build_seconds is None else f"{image.build_seconds}s"

    cpu, cuda = images["cpu"], images["cuda"]
    line = (f"image-test\t{cpu.ref.rsplit(':', 1)[1]}\tcpu {mb(cpu)}MB built in {built(cpu)}"
            f"\tcuda {mb(cuda)}MB built in {built(cuda)}\n")
    logs = cache_dir() / "build-logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "summary.tsv", "a") as f:
        f.write(line)
    with capsys.disabled():
        print(f"\n  images: {cpu.ref} {mb(cpu)} MB (built in {built(cpu)}), "
              f"{cuda.ref} {mb(cuda)} MB (built in {built(cuda)})")
    for image in (cpu, cuda):
        assert mb(image) <= MAX_MB[image.target], f"{image.ref}: {mb(image)} MB"
