"""A trivial HTTP/1.1 upstream shaped like llama.cpp, for the gateway benchmark and tests.

It answers every request at once with a small fixed JSON body carrying llama.cpp-style
`timings`, so what a benchmark measures is the gateway, not a model. Raw asyncio (no web
framework): on 2 shared cores the stub must cost far less than what it measures.
Run: python -m extproc.bench.stub_upstream PORT [PORT ...]
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
    """Answers each complete request (content-length or chunked body) with RESPONSE."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.buffer = b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := request_end(self.buffer)) is not None:
            self.buffer = self.buffer[end:]
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]


def request_end(buffer: bytes) -> int | None:
    """Where the first complete HTTP/1.1 message in ``buffer`` ends, None if incomplete."""
    head_end = buffer.find(b"\r\n\r\n")
    if head_end < 0:
        return None
    head = buffer[:head_end].lower()
    position = head_end + 4
    if b"transfer-encoding: chunked" not in head:
        index = head.find(b"content-length:")
        length = (
            int(head[index + 15 : head.find(b"\r\n", index) if head.find(b"\r\n", index) > 0 else None])
            if index >= 0
            else 0
        )
        return position + length if len(buffer) >= position + length else None
    while True:  # chunks: size line, data, CRLF; a 0-size chunk then CRLF ends the body
        line_end = buffer.find(b"\r\n", position)
        if line_end < 0:
            return None
        size = int(buffer[position:line_end].split(b";")[0], 16)
        position = line_end + 2 + size + 2
        if len(buffer) < position:
            return None
        if size == 0:
            return position


async def serve(port: int, host: str = "127.0.0.1") -> asyncio.base_events.Server:
    loop = asyncio.get_running_loop()
    return await loop.create_server(_Stub, host, port)


async def _main(ports: list[int]) -> None:
    servers = [await serve(port) for port in ports]
    for server in servers:
        print(f"stub upstream on 127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(_main([int(port) for port in sys.argv[1:]] or [0]))
