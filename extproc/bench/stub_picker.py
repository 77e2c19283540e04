"""A do-nothing Endpoint Picker for the InferencePool data planes
(extproc.service.dataplanes.picker_gateways),
for the benchmark's floor there: gRPC over TLS (a self-signed certificate made at start),
every phase answered as such a gateway expects, one fixed endpoint picked, nothing routed,
logged or counted. Envoy + this = what Envoy + a Python grpc.aio picker cost in that mode.

Full-duplex bodies are streamed back chunk by chunk as they came; buffered ones pass unchanged.
Run: python -m extproc.bench.stub_picker PORT ENDPOINT
"""

from __future__ import annotations

import asyncio
import datetime
import sys
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from extproc.envoy.contract import DESTINATION
from extproc.service.processor import SERVICE

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
# the health services the Endpoint Picker protocol lists (docs/proposals/004-endpoint-picker-protocol)
PICKER_HEALTH_SERVICES = ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")


def self_signed(host: str) -> tuple[bytes, bytes]:
    """(private key, certificate) as PEM, valid for a day for ``host``."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1)).not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, certificate.public_bytes(serialization.Encoding.PEM)


def answers(endpoint: str) -> dict[str, bytes]:
    """The fixed answers, serialized once: the pick, and a plain continue for every other phase.
    An empty endpoint picks nothing (what the data plane does with a request the picker let pass)."""
    pick = pb.HeadersResponse(response=pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DESTINATION, raw_value=endpoint.encode()))
    ] if endpoint else [])))
    # the pick in envoy.lb metadata too, as the protocol asks (what an override_host pool reads)
    metadata = struct_pb2.Struct()
    if endpoint:
        metadata.update({"envoy.lb": {DESTINATION: endpoint}})
    return {
        "request_headers": pb.ProcessingResponse(request_headers=pick, dynamic_metadata=metadata).SerializeToString(),
        "response_headers": pb.ProcessingResponse(response_headers=pb.HeadersResponse()).SerializeToString(),
        "request_body": pb.ProcessingResponse(request_body=pb.BodyResponse()).SerializeToString(),
        "response_body": pb.ProcessingResponse(response_body=pb.BodyResponse()).SerializeToString(),
        "request_trailers": pb.ProcessingResponse(request_trailers=pb.TrailersResponse()).SerializeToString(),
        "response_trailers": pb.ProcessingResponse(response_trailers=pb.TrailersResponse()).SerializeToString(),
    }


def echo(phase: str, body: pb.HttpBody) -> bytes:
    """A full-duplex chunk streamed back unchanged."""
    streamed = pb.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
    response = pb.BodyResponse(response=pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed)))
    return pb.ProcessingResponse(**{phase: response}).SerializeToString()


async def serve(port: int, endpoint: str) -> None:
    fixed = answers(endpoint)

    async def process(requests: Any, _context: grpc.aio.ServicerContext) -> Any:
        duplex = {"request_body": False, "response_body": False}
        async for message in requests:
            if message.HasField("protocol_config"):
                duplex = {"request_body": message.protocol_config.request_body_mode == FULL_DUPLEX,
                          "response_body": message.protocol_config.response_body_mode == FULL_DUPLEX}
            phase = message.WhichOneof("request")
            if phase in duplex and duplex[phase]:
                yield echo(phase, getattr(message, phase))
            else:
                yield fixed[phase]

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.stream_stream_rpc_method_handler(
        process, request_deserializer=pb.ProcessingRequest.FromString, response_serializer=lambda b: b
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Process": handler}),))
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([self_signed("127.0.0.1")]))
    await server.start()
    for name in PICKER_HEALTH_SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    print(f"stub endpoint picker (TLS) on 127.0.0.1:{port} -> {endpoint}", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    asyncio.run(serve(int(sys.argv[1]), sys.argv[2]))
