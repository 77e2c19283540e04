"""A plain `locust -f locustfiles/chat.py --headless ...` keeps the checkout clean; records only where asked."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from experiments.labs import free_port
from experiments.test_run import TINY
from extproc.bench.stub_upstream import RESPONSE, request_end
from extproc.experiments.run import LOCUSTFILE


def _locust(cwd, host, *extra):
    command = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", "2", "-r", "10",
               "--host", host, "-t", "60s", "--only-summary", "--traffic-profile", str(cwd / "tiny.json"), *extra]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=180)


def test_records_are_written_only_to_records_dir(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(dataclasses.asdict(TINY)))
    port = free_port()
    stub = subprocess.Popen([sys.executable, "-m", "extproc.bench.stub_upstream", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "stub upstream did not start"
                time.sleep(0.2)
        plain = _locust(tmp_path, f"http://127.0.0.1:{port}")
        assert "request rows not kept (no --records-dir)" in plain.stdout + plain.stderr
        assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.json"]
        asked = _locust(tmp_path, f"http://127.0.0.1:{port}", "--records-dir", str(tmp_path / "run"))
        assert "4 request rows ->" in asked.stdout + asked.stderr, asked.stdout + asked.stderr
        assert (tmp_path / "run" / "requests.parquet").exists()
    finally:
        stub.terminate()
        stub.wait(timeout=10)


def test_new_connections_sends_every_request_on_a_connection_of_its_own(tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(dataclasses.asdict(TINY)))  # 2 users, 2 chats of 2 turns
    with _counting_upstream() as (url, seen):
        _locust(tmp_path, url)
        kept = Counter(seen)
        seen.clear()
        _locust(tmp_path, url, "--new-connections")
    assert kept["requests"] == seen["requests"] == 4, (kept, seen)
    assert kept["connections"] <= 2 < seen["connections"] == 4, (kept, seen)  # a user's session keeps one


class _Counted(asyncio.Protocol):
    """stub_upstream's answer, counting connections and requests."""

    def __init__(self, seen: Counter) -> None:
        self.seen = seen
        self.buffer = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.seen["connections"] += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while (end := request_end(self.buffer)) is not None:
            self.buffer = self.buffer[end:]
            self.seen["requests"] += 1
            self.transport.write(RESPONSE)  # type: ignore[attr-defined]


@contextmanager
def _counting_upstream() -> Iterator[tuple[str, Counter]]:
    seen: Counter = Counter()
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(loop.create_server(lambda: _Counted(seen), "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        server.close()
        loop.close()
