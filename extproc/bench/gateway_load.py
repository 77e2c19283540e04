"""The gateway benchmarks' client: closed-loop HTTP/1.1 connections sending chat requests, and
the CPU time a process spent (Linux /proc)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

from extproc.stack.processes import Running

WARMUP_SECONDS = 0.5


def bench_requests(conversations: int) -> list[bytes]:
    out = []
    for i in range(conversations):
        body = json.dumps(
            {
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"Question {i}: hello?"},
                ],
                "max_tokens": 16,
            }
        ).encode()
        out.append(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: bench\r\ncontent-type: application/json\r\n"
            + f"x-conversation-id: bench-{i}\r\nx-turn: 1\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
    return out


async def load(ports: list[int], connections: int, seconds: float, conversations: int) -> dict[str, Any]:
    """Closed loop: each connection sends its next request as soon as the previous answer is read."""
    requests = bench_requests(conversations)
    warmup_end = time.perf_counter() + WARMUP_SECONDS
    end = warmup_end + seconds
    latencies: list[int] = []
    errors = [0]
    first_error: list[str] = []

    async def client(index: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", ports[index % len(ports)])
        i = index
        try:
            while True:
                request = requests[i % len(requests)]
                i += connections
                started = time.perf_counter_ns()
                writer.write(request)
                head = await reader.readuntil(b"\r\n\r\n")
                await read_body(reader, head)
                now = time.perf_counter()
                if now > end:
                    return
                if now > warmup_end:
                    latencies.append(time.perf_counter_ns() - started)
                    if not head.startswith(b"HTTP/1.1 200"):
                        errors[0] += 1
                        if not first_error:
                            first_error.append(head.split(b"\r\n", 1)[0].decode(errors="replace"))
        finally:
            writer.close()

    await asyncio.gather(*(client(i) for i in range(connections)))
    latencies.sort()
    count = len(latencies)
    return {
        "requests": count,
        "errors": errors[0],
        "first_error": first_error[0] if first_error else "",
        "rps": round(count / seconds, 1),
        "p50_ms": round(latencies[count // 2] / 1e6, 3) if count else float("nan"),
        "p99_ms": round(latencies[min(count - 1, int(count * 0.99))] / 1e6, 3) if count else float("nan"),
    }


async def read_body(reader: asyncio.StreamReader, head: bytes) -> None:
    lower = head.lower()
    if b"transfer-encoding: chunked" in lower:
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            await reader.readexactly(size + 2)
            if size == 0:
                return
    index = lower.find(b"content-length:")
    if index >= 0:
        await reader.readexactly(int(lower[index + 15 : lower.find(b"\r\n", index)].strip()))


def cpu_seconds(running: Running) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{running.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
