"""Labs and helpers for the runner tests."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DirectLab:
    """One replica as its own gateway (no router): exercises the runner, Locust and records.

    Policies cannot differ here (nothing routes), so set_policy only notes the call;
    scale notes the target, as a platform would after starting a replica.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self.gateway_url = f"http://{address}"
        self.calls: list[tuple] = []
        self.count = 1

    def set_policy(self, routing: dict) -> None:
        self.calls.append(("set_policy", routing["policy"]))

    def reset(self) -> None:
        self.calls.append(("reset",))

    def scale(self, n: int) -> None:
        self.calls.append(("scale", n))
        self.count = n

    def replicas(self) -> dict[str, str]:
        return {"llm-0": self.address}

    def replica_headers(self) -> dict[str, str]:
        return {}  # the test's replica wants no key
