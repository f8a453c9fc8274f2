# vllm-capacity: the sidecar image. Build: docker build -t vllm-capacity:0.1.0 .
# Multi-stage: the wheel is built in the first stage; the final image holds Python, the wheel's pinned
# dependencies and nothing else (no compilers, no build tools, no source tree).
# The base image by digest (a tag can be pushed again; a digest cannot), its tag beside it for people.
# scripts/refresh-base-image pins the digest the tag points at now (or --tag another one).
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:081075da77b2b55c23c088251026fb69a7b2bf92471e491ff5fd75c192fd38e5

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY agent ./agent
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /dist .

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="vllm-capacity" \
      org.opencontainers.image.description="Sidecar agent and Prometheus exporter for vLLM serving capacity: KV cache in tokens, concurrency, GPU memory budget." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.source="https://github.com/vllm-capacity/vllm-capacity"
COPY --from=build /dist /tmp/dist
RUN pip install --no-cache-dir /tmp/dist/*.whl && rm -rf /tmp/dist
# Nothing is written at run time (no .pyc, logs go to stderr), so a read-only root filesystem works.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    VLLM_CAPACITY_LISTEN=:9790
# A fixed, unprivileged UID/GID (no /etc/passwd entry needed), matching the Kubernetes securityContext.
USER 65532:65532
EXPOSE 9790
ENTRYPOINT ["vllm-capacity"]
CMD ["serve"]
