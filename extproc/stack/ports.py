"""The local stack's ports: which are free, which the stack takes, and what each is for."""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping
from typing import Any

from pydantic import Field

from extproc.stack.errors import StackError
from extproc.strict import Strict

HOST = "127.0.0.1"  # every process of the local stack listens on loopback only
PORTS_PER_GATEWAY = 4  # Envoy listener, Envoy admin, router gRPC, router metrics


class PortsSection(Strict):
    """0 = any free port (tests)."""

    gateway: int = Field(ge=0, lt=65536)
    envoy_admin: int = Field(ge=0, lt=65536)
    router: int = Field(ge=0, lt=65536)
    metrics: int = Field(ge=0, lt=65536)
    replica_base: int = Field(ge=0, lt=65536)
    gateway_base: int = Field(ge=0, lt=65536)
    store: int = Field(ge=0, lt=65536)


class PortInUse(RuntimeError):
    def __init__(self, port: int, what: str) -> None:
        super().__init__(f"port {port} (for {what}) is already in use on 127.0.0.1: "
                         f"stop whatever listens there or choose another port")
        self.port = port


def check_ports_free(ports: Mapping[int, str], wait: float = 0.0) -> None:
    """PortInUse naming the first port (and its purpose) that something listens on.

    Waits up to `wait` seconds for a port to free up (a restart on the same port).
    """
    deadline = time.monotonic() + wait
    for port, what in ports.items():
        while not _bindable(port):
            if time.monotonic() > deadline:
                raise PortInUse(port, what)
            time.sleep(0.1)


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        # as servers do: connections of a stopped server in TIME_WAIT must not count
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


def free_ports(n: int) -> list[int]:
    """n distinct ports the kernel has free right now (for tests)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def allocate(section: PortsSection, count: int, gateways: int) -> dict[str, Any]:
    """The stack's ports from [ports]: fixed ones as given, 0 ones free now; "spare" holds the
    free ports left for the gateways when gateway_base is 0 (gateways.layout takes them)."""
    fixed = section.model_dump()
    bases = ("replica_base", "gateway_base")
    needed = (sum(1 for key, v in fixed.items() if v == 0 and key not in bases)
              + (count if section.replica_base == 0 else 0)
              + (PORTS_PER_GATEWAY * gateways if section.gateway_base == 0 and gateways > 1 else 0))
    spare = free_ports(needed)
    named = {key: (value or spare.pop()) for key, value in fixed.items() if key not in bases}
    base = section.replica_base
    named["replicas"] = [base + i if base else spare.pop() for i in range(count)]
    named["spare"] = spare
    return named


def distinct(purposes: list[tuple[int, str]]) -> dict[int, str]:
    """{port: purpose}; one port given two purposes (overlapping [ports]) stops start-up."""
    found: dict[int, str] = {}
    for port, what in purposes:
        if port in found:
            raise StackError(f"[ports]: port {port} is both for {found[port]} and for {what}")
        found[port] = what
    return found


def port_of(address: str) -> int:
    """The port of host:port, http://host:port/path or redis://user@host:port/db."""
    return int(address.rsplit(":", 1)[1].split("/", 1)[0])
