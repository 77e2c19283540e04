"""A private redis-server (Debian's package; `make setup` installs it) for tests, benchmarks
and local stacks: on 127.0.0.1 only, nothing written to disk, bounded memory (least recently
used keys with a TTL evicted first), its log in the caller's directory; a child process that
``Running.stop`` ends. Never the machine's system-wide service."""

from __future__ import annotations

import shutil
from pathlib import Path

from extproc.stack.processes import Running, StartError, accepts, free_port, spawn_child, wait_until_ready

MAX_MEMORY = "256mb"


def redis_server_binary() -> str | None:
    return shutil.which("redis-server") or shutil.which("redis-server", path="/usr/bin:/usr/sbin")


def start_redis(workdir: Path, port: int | None = None) -> Running:
    """redis-server on 127.0.0.1:``port`` (a free one by default); ``address`` is host:port."""
    binary = redis_server_binary()
    if binary is None:
        raise StartError("no redis-server: `make setup` installs Debian's package (apt-get install redis-server)")
    port = port or free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    command = [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(workdir), "--maxmemory", MAX_MEMORY, "--maxmemory-policy", "volatile-lru",
        "--daemonize", "no", "--supervised", "no",
    ]  # fmt: skip
    running = spawn_child("redis-server", command, workdir / f"redis-{port}.log")
    wait_until_ready(running, lambda: accepts(port), 10.0)
    running.address = f"127.0.0.1:{port}"
    return running
