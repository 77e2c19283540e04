# The router image: `llm-ring serve` (the ext_proc routing service) and the replicas' slot sidecar
# (python -m extproc.migration.drain_k8s, k8s/20-llm.yaml), nothing else.
#   docker build -t llm-ring-router:0.1.0 .
#   kind load docker-image llm-ring-router:0.1.0 --name llm-ring
# Runs as a non-root user on a read-only root filesystem (k8s/43-gateway.yaml).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# a C compiler for the routing core compiled with mypyc (extproc/compiled.py); not in the final image
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/llm-ring && python -m venv /opt/build
COPY constraints.txt ./
# Only the distributions `llm-ring serve` imports, at the project's pinned versions
# (tests/k8s/test_k8s_manifests.py checks this list against the service's imports).
RUN /opt/llm-ring/bin/pip install --no-cache-dir -c constraints.txt \
        grpcio grpcio-health-checking xds-protos protobuf xxhash pydantic structlog \
        prometheus-client kubernetes orjson redis mypy_extensions cryptography gguf tokenizers Jinja2 tomli_w httpx
# the build venv: mypyc and what the compiled modules import, for their types
RUN /opt/build/bin/pip install --no-cache-dir -c constraints.txt mypy setuptools xxhash pydantic mypy_extensions
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY scripts/build-core ./scripts/
# compiled into extproc/_compiled/ (package data of the install below); the service checks it
# against its sources at start-up (LLM_RING_CORE=compiled below: a build that does not match stops it)
RUN /opt/build/bin/python scripts/build-core \
    && /opt/llm-ring/bin/pip install --no-cache-dir --no-deps .

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/llm-ring /opt/llm-ring
ENV PATH=/opt/llm-ring/bin:$PATH \
    LLM_RING_CORE=compiled \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["llm-ring"]
CMD ["serve", "--config", "/etc/llm-ring/router.toml"]
