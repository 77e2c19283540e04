"""A trivial HTTP/1.1 upstream shaped like llama.cpp, for the gateway benchmark and tests.

It answers every request at once with a small fixed JSON body carrying llama.cpp-style
`timings`, so what a benchmark measures is the gateway, not a model. Raw asyncio (no web
framework): on 2 shared cores the stub must cost far less than what it measures.
Run: python -m extproc.service.stub_upstream PORT
"""

from __future__ import annotations

import asyncio
import json
import sys

BODY = json.dumps(
    {
        "content": "ok",
        "timings": {"cache_n": 3, "prompt_n": 5, "prompt_ms": 1.0, "predicted_n": 1, "predicted_ms": 1.0},
    }
).encode()
RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(BODY)).encode()
    + b"\r\n\r\n"
    + BODY
)


class _Stub(asyncio.Protocol):
    """Answers each complete request (headers + content-length body) with RESPONSE."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            head_end = self.buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            length = _content_length(self.buffer[:head_end])
            end = head_end + 4 + length
            if len(self.buffer) < end:
                return
            self.buffer = self.buffer[end:]
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


async def serve(port: int, host: str = "127.0.0.1") -> asyncio.base_events.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(_Stub, host, port)


async def _main(port: int) -> None:
    server = await serve(port)
    print(f"stub upstream on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(_main(int(sys.argv[1]) if len(sys.argv) > 1 else 0))
