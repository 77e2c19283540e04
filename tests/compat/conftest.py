"""The compatibility suite's real parts, shared by its modules: two real llama.cpp replicas
(SmolLM2-135M, served as "smollm2", wanting their API key) and, in turn, each data plane in front
of them: our own Envoy, and Envoy AI Gateway's InferencePool plane with full-duplex bodies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.service.gateway_support import Gateway, LlamaReplicas, data_plane, llama_replicas

PLANES = ("own-envoy", "ai-gateway-duplex")


@pytest.fixture(scope="package")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaReplicas]:
    with llama_replicas(tmp_path_factory.mktemp("replicas")) as replicas:
        yield replicas


@pytest.fixture(scope="package", params=PLANES)
def plane(request: pytest.FixtureRequest, llama: LlamaReplicas, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Gateway]:
    with data_plane(request.param, tmp_path_factory.mktemp(request.param), llama, routing_headers="true") as gw:
        gw.wait_for_models()
        yield gw
