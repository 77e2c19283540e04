"""A private redis-server (Debian's package; `make setup` installs it) for tests, benchmarks
and the local stack's gateways: on 127.0.0.1 only, nothing written to disk, bounded memory
(least recently used keys with a TTL evicted first: every key the routers write has one),
its log in the caller's directory. Never the machine's system-wide service."""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from extproc.stack.processes import Running, StartError, accepts, free_port, spawn_child, wait_until_ready

HOST = "127.0.0.1"
MAX_MEMORY = "256mb"


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")


def redis_command(binary: str, port: int, folder: Path) -> list[str]:
    """The server's command line: the shared state is rebuilt by the routers (no snapshots,
    no append-only file; a restart starts empty)."""
    return [
        binary, "--port", str(port), "--bind", HOST, "--dir", str(folder), "--save", "", "--appendonly", "no",
        "--maxmemory", MAX_MEMORY, "--maxmemory-policy", "volatile-lru", "--daemonize", "no", "--protected-mode", "yes",
    ]  # fmt: skip


def start_redis(workdir: Path, port: int | None = None) -> Running:
    """redis-server on 127.0.0.1:``port`` (a free one by default), a child process that
    ``Running.stop`` ends; ``address`` is host:port."""
    binary = redis_server_binary()
    if binary is None:
        raise StartError("no redis-server: `make setup` installs Debian's package (apt-get install redis-server)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    running = spawn_child("redis-server", redis_command(binary, port, workdir), workdir / f"redis-{port}.log")
    wait_until_ready(running, lambda: accepts(port), 10.0)
    running.address = f"{HOST}:{port}"
    return running


def redis_answers(port: int, timeout: float = 1.0) -> bool:
    """The server on `port` answers PING with +PONG."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
