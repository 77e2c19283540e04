"""The lab the experiment runner drives: a gateway plus control over policy, state, scale.

The local stack implements it (extproc.stack.lab.LocalLab); ``RemoteLab`` drives any
gateway whose routing service's admin port is reachable (e.g. through a port-forward).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Lab(Protocol):
    @property
    def gateway_url(self) -> str:
        """Base URL clients send /v1/chat/completions to."""

    def set_policy(self, routing: dict[str, Any]) -> None:
        """Change [routing] settings (e.g. {"policy": "bounded"}); unnamed keys keep their values."""

    def reset(self) -> None:
        """Fresh replica caches and router state (load, placement memory, policy state)."""

    def scale(self, n: int) -> None:
        """Run ``n`` replicas; returns once they are ready and the router knows them."""

    def replicas(self) -> dict[str, str]:
        """The ready replicas: {name: "ip:port"}."""

    def replica_headers(self) -> dict[str, str]:
        """What a request straight to a replica carries: their API key ({}: they want none)."""


@runtime_checkable
class GatewayTier(Protocol):
    """A lab with several gateways behind one front (the local stack with `--gateways N`)."""

    def routers(self) -> dict[str, str]:
        """Every gateway's routing service: {gateway name: admin gRPC address}."""

    def kill_part(self, name: str) -> float:
        """SIGKILL a gateway's Envoy and routing service, or the store (name "store"); nothing
        restarts them meanwhile. Returns the wall-clock time of the signal."""

    def restart_part(self, name: str) -> None:
        """Start a killed gateway or store again; returns once it accepts requests."""

    def router_states(self) -> dict[str, dict[str, int]]:
        """Per gateway: in_flight_requests, in_flight_tokens, decisions of its router."""


class LabError(RuntimeError):
    """The lab cannot do what the experiment needs; the message says what and why."""


class RemoteLab:
    """A gateway elsewhere: policy and router state through the admin API.

    Replica caches cannot be emptied remotely (llama.cpp refuses slot actions without
    ``--slot-save-path``); the runner starts every conversation with a per-run session
    line, so one run never finds another run's conversations in a cache anyway.
    Scaling is the platform's job (kubectl scale), so ``scale`` refuses.
    """

    def __init__(self, gateway_url: str, admin_address: str) -> None:
        from extproc.service.admin_client import AdminClient

        self.gateway_url = gateway_url
        self._admin = AdminClient(admin_address)

    def set_policy(self, routing: dict[str, Any]) -> None:
        self._admin.set_routing(routing)

    def reset(self) -> None:
        self._admin.reset()

    def scale(self, n: int) -> None:
        raise LabError("a remote lab cannot scale replicas; drop --scale-at or use the local stack")

    def roll(self, name: str, migrate: bool | None) -> dict[str, Any]:
        raise LabError("a remote lab cannot restart replicas; drop --roll-at or use the local stack")

    def replicas(self) -> dict[str, str]:
        return {r["name"]: r["address"] for r in self._admin.state()["replicas"] if r["healthy"]}

    def replica_headers(self) -> dict[str, str]:
        return {}  # the replicas' key stays in the cluster: refused (401), the context check is skipped
