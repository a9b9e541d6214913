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

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04

# ---- GPU: build the environment on the CUDA base (its Python is Ubuntu's 3.12) ---------
FROM ${CUDA_IMAGE} AS cuda-build
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1
# Ubuntu's Python packages follow the release's security updates; pinning their exact
# versions would break the build whenever the archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN python3 -m venv /opt/flowmill \
    && /opt/flowmill/bin/pip install --no-cache-dir '.[gpu,examples]' \
    && /opt/flowmill/bin/pip uninstall --yes pip

# ---- GPU image: CUDA runtime libraries + Python + the environment ----------------------
FROM ${CUDA_IMAGE} AS cuda
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 65532 flowmill \
    && useradd --uid 65532 --gid 65532 --home-dir /home/flowmill --create-home \
        --shell /usr/sbin/nologin flowmill
COPY --from=cuda-build /opt/flowmill /opt/flowmill
COPY --from=cuda-build /src/examples /home/flowmill/examples
LABEL org.opencontainers.image.title="flowmill-cuda" \
      org.opencontainers.image.description="Flowmill dataflow runtime and Kubernetes operator, CuPy kernels on CUDA 12" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/flowmill/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /home/flowmill
USER 65532:65532
EXPOSE 8080 9090
CMD ["kopf", "run", "-m", "flowmill.operator.controller", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]

# ---- CPU: build the environment ---------------------------------------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY . .
RUN python -m venv /opt/flowmill \
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
CMD ["kopf", "run", "-m", "flowmill.operator.controller", "--all-namespaces", "--standalone", "--liveness=http://0.0.0.0:8080/healthz"]
