"""Starting the benchmark's stubs (stub_upstream.py, stub_processor.py) as processes, with
the stack's process helpers: each start waits until the stub accepts connections."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from extproc.envoy.contract import ext_proc_address
from extproc.stack.processes import Running, accepts, socket_name, spawn_child, wait_until_ready


def start_stub_upstream(ports: Sequence[int], workdir: Path) -> Running:
    """The llama.cpp-shaped upstream (stub_upstream.py) on each of ``ports``."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "extproc.bench.stub_upstream", *map(str, ports)]
    running = spawn_child("stub upstream", command, workdir / "stub.log")
    wait_until_ready(running, lambda: all(accepts(port) for port in ports), 10.0)
    return running


def start_stub_processor(port: int, endpoint: str, workdir: Path) -> Running:
    """The do-nothing ext_proc server (benchmark floor), answering every request with endpoint."""
    workdir.mkdir(parents=True, exist_ok=True)
    address = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "extproc.bench.stub_processor", str(port), endpoint, socket_name(address)]
    running = spawn_child("stub ext_proc", command, workdir / "stub_processor.log")
    wait_until_ready(running, lambda: accepts(port), 10.0)
    running.address = address
    running.ext_proc = ext_proc_address(address, socket_name(address))
    return running
