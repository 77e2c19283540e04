"""A do-nothing ext_proc server speaking the gateway's protocol, for the benchmark's floor.

It answers like `llm-ring serve` (reads the headers and the body, answers the headers with
one fixed pick, lets the body pass, which ends the stream; observer streams and access log
streams read to the end) but routes nothing, logs nothing and counts nothing: Envoy + this =
what Envoy + Python grpc.aio cost.
Run: python -m extproc.bench.stub_processor PORT ENDPOINT [SOCKET]  (SOCKET: also listen on
that abstract unix socket, as `llm-ring serve` does on service.ext_proc_socket)
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.service.answers import BODY_CONTINUE
from extproc.service.dataplanes.own_envoy import ACCESS_LOG_SERVICE, OWN_ENVOY
from extproc.service.processor import SERVICE


async def serve(port: int, endpoint: str, socket: str = "") -> None:
    pick = OWN_ENVOY.pick(endpoint, "stub", "home", streamed=False, routing_headers=True, replica_key="")

    async def process(_requests: Any, context: grpc.aio.ServicerContext) -> None:
        message = await context.read()
        if message is grpc.aio.EOF:
            return
        if message.observability_mode:
            while message is not grpc.aio.EOF and not message.response_body.end_of_stream:
                message = await context.read()
            return
        await context.read()  # the body, sent without waiting (one chunk)
        await context.write(pick)
        await context.write(BODY_CONTINUE)

    async def access_logs(requests: Any, _context: grpc.aio.ServicerContext) -> bytes:
        async for message in requests:
            for entry in message.http_logs.log_entry:
                entry.request.request_id  # noqa: B018 - touch what the service reads
        return b""

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=pb.ProcessingRequest.FromString, response_serializer=lambda b: b
    )
    log_handler = grpc.stream_unary_rpc_method_handler(
        access_logs, request_deserializer=als_pb2.StreamAccessLogsMessage.FromString, response_serializer=lambda b: b
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(SERVICE, {"Process": handler}),
            grpc.method_handlers_generic_handler(ACCESS_LOG_SERVICE, {"StreamAccessLogs": log_handler}),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    if socket:
        server.add_insecure_port(f"unix-abstract:{socket}")
    await server.start()
    print(f"stub ext_proc on 127.0.0.1:{port} -> {endpoint}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2], *sys.argv[3:4]))
