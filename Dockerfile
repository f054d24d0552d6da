# syntax=docker/dockerfile:1
# splitserve image: one entrypoint (`splitserve`), the embedded model baked in, runs as a non-root user.
#   CPU (default):  docker build -t splitserve .
#   CUDA:           docker build -t splitserve:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#                     --build-arg DEVICE=cuda .
#                   (DEVICE sets PD_DEVICE, the workers' default --device: cuda puts weights, KV cache and sampler on the GPU)
# The same image runs every role: `docker run splitserve router|prefill|decode|kvstore-master|kvstore-node ...`;
# configuration comes from PD_* environment variables (README: "Configuration reference").

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, pinned, from the chosen index (CPU wheels by default; an unpinned torch would pull a CUDA build)
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /opt/splitserve
COPY pyproject.toml README.md ./
COPY splitserve/ splitserve/
COPY gen/ gen/
COPY protos/ protos/
COPY models/ models/
# editable install: splitserve.paths finds the baked-in model relative to the source tree
RUN pip install -e . && python -c "import splitserve.cli, pd.v1.router_pb2"
# splitserve's CPU kernels, compiled here (g++ only in this stage) into the tree the runtime stage copies; g++ is not
# pinned: it is whatever the pinned base image's Debian release ships, and it never reaches the runtime image
ENV PD_KERNEL_CACHE=/opt/splitserve/.kernels
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && python -m splitserve.kernels.build

FROM ${PYTHON_IMAGE} AS runtime
ARG DEVICE=cpu
LABEL org.opencontainers.image.title="splitserve" \
      org.opencontainers.image.description="Prefill/decode disaggregated LLM serving" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 splitserve \
 && useradd --system --uid 10001 --gid splitserve --home-dir /home/splitserve --create-home splitserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build --chown=root:root /opt/splitserve /opt/splitserve
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PD_KERNEL_CACHE=/opt/splitserve/.kernels \
    PD_MODEL=/opt/splitserve/models/TinyStories-656K \
    PD_DEVICE=${DEVICE} \
    PD_HOST=0.0.0.0 \
    PD_DATA_HOST=0.0.0.0 \
    UCX_TLS=tcp,self \
    UCX_TCP_CM_REUSEADDR=y \
    UCX_MM_ERROR_HANDLING=y \
    UCX_WARN_UNUSED_ENV_VARS=n
WORKDIR /home/splitserve
USER 10001:10001
# router HTTP, router gRPC, prefill gRPC, prefill KV data, decode gRPC, KV store master, node gRPC, node data, /metrics
EXPOSE 8000 50050 50061 50062 50071 50090 50091 50092 9100
ENTRYPOINT ["splitserve"]
CMD ["--help"]
