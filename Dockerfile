# syntax=docker/dockerfile:1
#
# Flowmill images: the operator, and the image training pods run.
#
#   docker build -t flowmill:0.1.0 .                          # CPU (NumPy kernels), the default
#   docker build --target cuda -t flowmill:0.1.0-cuda .       # GPU (CuPy kernels, CUDA 12)
#
# Both hold the project installed (not editable) in the virtual environment /opt/flowmill
# with the examples' dependencies, and the examples in the working directory, so
# `kubectl apply -f examples/digits/job.yaml` runs `python examples/digits/train.py` as
# is; they run as the unprivileged user 65532 and start the operator by default. The
# Helm chart in charts/flowmill sets the command and arguments itself.
#
# Both start from the same Python base, PYTHON_IMAGE: any Debian-like image with Python
# >= 3.11 as `python3`, its venv module, ca-certificates, libstdc++ and useradd
# (e2e/image.sh builds one from Debian's packages where no image registry is reachable).
# The GPU image adds CuPy and the CUDA 12 runtime libraries it loads (cudart and its
# headers, NVRTC, cuBLAS, cuRAND) from their wheels (the `gpu` extra): of CUDA, the node's
# NVIDIA driver is all it needs.
#
# PIP_INDEX_URL, PIP_CERT (a CA bundle, e.g. a TLS-intercepting proxy's, mounted into the
# build's RUN steps) and PIP_DEFAULT_TIMEOUT may be given as build arguments: they reach
# pip in the build stages only, never the images.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- GPU: build the environment: CuPy and its CUDA runtime wheels ------------------------
FROM ${PYTHON_IMAGE} AS cuda-build
ARG PIP_INDEX_URL
ARG PIP_CERT
ARG PIP_DEFAULT_TIMEOUT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/flowmill \
    && /opt/flowmill/bin/pip install --no-cache-dir '.[gpu,examples]' \
    && /opt/flowmill/bin/pip uninstall --yes pip setuptools

# ---- GPU image ----------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS cuda
RUN groupadd --gid 65532 flowmill \
    && useradd --uid 65532 --gid 65532 --home-dir /home/flowmill --create-home \
        --shell /usr/sbin/nologin flowmill
COPY --from=cuda-build /opt/flowmill /opt/flowmill
COPY --from=cuda-build /src/examples /home/flowmill/examples
LABEL org.opencontainers.image.title="flowmill-cuda" \
      org.opencontainers.image.description="Flowmill dataflow runtime and Kubernetes operator, CuPy kernels on CUDA 12" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
# CuPy makes its kernel cache directory when imported: under /tmp, which stays writable
# where the root filesystem is read-only (an emptyDir), rather than in $HOME.
# NVIDIA_DRIVER_CAPABILITIES asks the NVIDIA container toolkit for the driver's compute
# libraries, and LD_LIBRARY_PATH finds them where GKE mounts them, as in the nvidia/cuda
# images; unlike those, NVIDIA_VISIBLE_DEVICES=all is not set: the device plugin (or
# `docker run --gpus`) names the GPUs a container gets, and a pod that asked for none
# sees none.
ENV PATH=/opt/flowmill/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CUPY_CACHE_DIR=/tmp/.cupy/kernel_cache \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64
WORKDIR /home/flowmill
USER 65532:65532
EXPOSE 8080 9090
CMD ["python", "-m", "flowmill.operator", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]

# ---- CPU: build the environment ---------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ARG PIP_INDEX_URL
ARG PIP_CERT
ARG PIP_DEFAULT_TIMEOUT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/flowmill \
    && /opt/flowmill/bin/pip install --no-cache-dir '.[examples]' \
    && /opt/flowmill/bin/pip uninstall --yes pip setuptools

# ---- CPU image (the default target: last in this file) ---------------------------------
FROM ${PYTHON_IMAGE} AS cpu
RUN groupadd --gid 65532 flowmill \
    && useradd --uid 65532 --gid 65532 --home-dir /home/flowmill --create-home \
        --shell /usr/sbin/nologin flowmill
COPY --from=build /opt/flowmill /opt/flowmill
COPY --from=build /src/examples /home/flowmill/examples
LABEL org.opencontainers.image.title="flowmill" \
      org.opencontainers.image.description="Flowmill dataflow runtime and Kubernetes operator, NumPy kernels" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/flowmill/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/flowmill
USER 65532:65532
EXPOSE 8080 9090
CMD ["python", "-m", "flowmill.operator", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
