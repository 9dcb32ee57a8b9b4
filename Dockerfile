# One image for the operator, the engine and the proxy: `decodectl operator|engine|proxy`.
#   docker build --build-arg TORCH_VARIANT=cpu  -t decodeservice:cpu .
#   docker build --build-arg TORCH_VARIANT=cu128 -t decodeservice:cuda .
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
COPY serving serving
COPY operator operator
COPY cli cli
COPY bench bench
RUN pip install ".[hf]"

# Cache the bundled model so `bundled://smollm2-135m` needs no network at start.
FROM build AS models
ENV HF_HOME=/opt/models/huggingface
RUN decodectl models pull smollm2-135m --cache-dir /opt/models

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.source="https://github.com/decodeservice/decodeservice" \
      org.opencontainers.image.description="DecodeService: engine, proxy and operator"
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
