# The router image: `llm-ring serve` (the ext_proc routing service) and nothing else.
#   docker build -t llm-ring-router:0.1.0 .
#   kind load docker-image llm-ring-router:0.1.0 --name llm-ring
# Runs as a non-root user on a read-only root filesystem (k8s/43-gateway.yaml).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN python -m venv /opt/llm-ring
COPY constraints.txt ./
# Only the distributions `llm-ring serve` imports, at the project's pinned versions
# (tests/k8s/test_k8s_manifests.py checks this list against the service's imports).
RUN /opt/llm-ring/bin/pip install --no-cache-dir -c constraints.txt \
        grpcio grpcio-health-checking xds-protos protobuf xxhash pydantic structlog \
        prometheus-client kubernetes orjson redis
COPY pyproject.toml README.md ./
COPY extproc ./extproc
RUN /opt/llm-ring/bin/pip install --no-cache-dir --no-deps .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/llm-ring /opt/llm-ring
ENV PATH=/opt/llm-ring/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["llm-ring"]
CMD ["serve", "--config", "/etc/llm-ring/router.toml"]
