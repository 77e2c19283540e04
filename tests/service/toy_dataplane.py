"""A toy data plane, added from outside (test_toy_dataplane.py registers it): a stream opened by
request headers carrying ``x-toy: 1`` takes the whole body in one message, is answered with the
pick's endpoint alone in ``x-toy-endpoint``, and ends its request with its own end after the
response's status and body have passed."""

from __future__ import annotations

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.service.answers import answer_to, header_option, more_headers
from extproc.service.dataplanes.plane import Serving, header_values
from extproc.service.waiting_room import HeldReads

TOY_HEADER = "x-toy"
ENDPOINT_HEADER = "x-toy-endpoint"


class ToyAnswers:
    access_logged = False  # the stream's end ends the request
    waits_announced = False

    def pick(self, destination: str, replica: str, reason: str, streamed: bool, routing_headers: bool,
             replica_key: str) -> bytes:
        endpoint = destination.partition(",")[0]
        mutation = pb.HeaderMutation(set_headers=[header_option(ENDPOINT_HEADER, endpoint)])
        return answer_to(pb.CommonResponse(header_mutation=mutation), False)

    def headers(self, headers: list[base_pb2.HeaderValueOption]) -> bytes:
        return more_headers(headers)

    def named(self, request_id: str) -> bytes:
        return b""


TOY_ANSWERS = ToyAnswers()


class ToyPlane:
    name = "toy"

    def claims(self, first: pb.ProcessingRequest, own_envoy: bool) -> str:
        opened = first.WhichOneof("request") == "request_headers"
        return "toy" if opened and header_values(first.request_headers, (TOY_HEADER,)).get(TOY_HEADER) == "1" else ""

    async def serve(self, first: pb.ProcessingRequest, stream: HeldReads, serving: Serving) -> None:
        values = header_values(first.request_headers, (":path", *serving.headers_read()))
        message = await stream.read()
        if message is grpc.aio.EOF:
            return
        answer, routed = await serving.route(
            stream, TOY_ANSWERS, values, path=values[":path"], content_type="application/json",
            session_headers=values, turn="", request_id="", body=message.request_body.body)
        await stream.write(answer)
        if routed is None:
            return
        requests = serving.gateway.requests
        try:
            while (message := await stream.read()) is not grpc.aio.EOF:
                if message.WhichOneof("request") == "response_headers":
                    status = header_values(message.response_headers, (":status",))[":status"]
                    requests.observe_start(routed, int(status), "")
                elif message.WhichOneof("request") == "response_body":
                    requests.observe_body(routed, message.response_body.body, message.response_body.end_of_stream)
        finally:
            requests.stream_ended(routed)


PLANE = ToyPlane()
