"""A data plane added from outside: tests/service/toy_dataplane.py and one register line, then a
request driven through the service's ext_proc servicer to its end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF
from structlog.testing import capture_logs

from extproc.service.dataplanes.registry import choose, register, unregister
from extproc.service.processor import Processor
from tests.service import toy_dataplane
from tests.service.test_gateway_lifecycle import ENDPOINTS, decisions, in_flight, make_gateway


@pytest.fixture
def toy() -> Iterator[None]:
    register(toy_dataplane.PLANE)  # the one registry line
    yield
    unregister("toy")


class Stream:
    """An ext_proc stream's gRPC context: the messages Envoy sends, and the answers written."""

    def __init__(self, messages: list[pb.ProcessingRequest]) -> None:
        self.messages = messages
        self.written: list[pb.ProcessingResponse] = []

    async def read(self) -> Any:
        return self.messages.pop(0) if self.messages else EOF

    async def write(self, answer: bytes) -> None:
        self.written.append(pb.ProcessingResponse.FromString(answer))

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"the stream failed: {details}")


def headers(pairs: dict[str, str]) -> pb.HttpHeaders:
    return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in pairs.items()]))


FIRST = pb.ProcessingRequest(request_headers=headers({":path": "/v1/chat/completions", "x-toy": "1",
                                                      "x-conversation-id": "c-1"}))


def test_a_request_goes_through_the_toy_plane_to_its_end(toy: None) -> None:
    gateway = make_gateway()
    body = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8})
    answer = b'{"choices": [{"message": {"content": "hi"}}], "timings": {"cache_n": 3, "prompt_n": 5}}'
    stream = Stream([
        FIRST,
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=headers({":status": "200"})),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=answer, end_of_stream=True)),
    ])
    with capture_logs() as logs:
        asyncio.run(Processor(gateway, own_envoy=False).process(None, stream))
    (written,) = stream.written
    (set_header,) = written.request_headers.response.header_mutation.set_headers
    (record,) = decisions(logs)
    assert (set_header.header.key, set_header.header.raw_value.decode()) == ("x-toy-endpoint", record["endpoint"])
    assert record["endpoint"] in ENDPOINTS.values()
    assert (record["outcome"], record["conversation"], record["cache_n"]) == ("ok", "c-1", 3), record
    assert in_flight(gateway) == 0 and not gateway.requests.pending


def test_the_toy_is_asked_before_the_endpoint_picker_and_only_while_registered(toy: None) -> None:
    chosen = choose(FIRST, own_envoy=False)
    assert chosen is not None and (chosen[0].name, chosen[1]) == ("toy", "toy")
    unregister("toy")
    chosen = choose(FIRST, own_envoy=False)
    assert chosen is not None and (chosen[0].name, chosen[1]) == ("endpoint-picker", "picker")
    with pytest.raises(ValueError, match="registered already"):
        register(toy_dataplane.PLANE)
        register(toy_dataplane.PLANE)
