"""A thin synchronous client of the Admin service, for experiments and tools.

with AdminClient("127.0.0.1:9002") as admin:
    admin.set_routing({"policy": "bounded", "epsilon": 0.5})
    admin.reset()
    print(admin.state()["replicas"])

A router's migration port wants its token: AdminClient(address, token=...).
"""

from __future__ import annotations

from typing import Any

import grpc

from extproc.service import admin_pb2, admin_pb2_grpc
from extproc.service.bearer import bearer_metadata
from extproc.settings import toml_text, toml_value


class AdminClient:
    def __init__(self, address: str, timeout: float = 5.0, token: str | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata = bearer_metadata(token)  # sent with every call
        self._channel = grpc.insecure_channel(address)
        self._stub = admin_pb2_grpc.AdminStub(self._channel)

    def set_routing(self, routing: dict[str, Any]) -> dict[str, Any]:
        """Change some [routing] settings: the policy, shared keys or the policy's own parameters
        (the others keep their values); returns the new state. ValueError names a bad key or value."""
        try:
            knobs = {key: toml_text(value) for key, value in routing.items()}
        except TypeError as exc:
            raise ValueError(f"invalid routing settings {routing!r}: {exc}") from None
        message = admin_pb2.RoutingSettings(knobs=knobs)
        return self._call(self._stub.SetRouting, admin_pb2.SetRoutingRequest(routing=message))

    def reset(self) -> dict[str, Any]:
        """Forget in-flight load, placement memory, policy state and conversations; returns the new state."""
        return self._call(self._stub.Reset, admin_pb2.ResetRequest())

    def state(self) -> dict[str, Any]:
        """{"routing": {...}, "replicas": [{name, address, healthy, in_flight_requests, in_flight_tokens}],
        "in_flight_requests", "in_flight_tokens", "decisions"}"""
        return self._call(self._stub.GetState, admin_pb2.StateRequest())

    def placements(self, replica: str) -> list[tuple[int, str, int]]:
        """(conversation key, opening key, prompt tokens) of the conversations last served by `replica`."""
        reply = self._stub.Placements(admin_pb2.PlacementsRequest(replica=replica), timeout=self.timeout,
                                      metadata=self._metadata)
        return [(c.key, c.opening, c.prompt_tokens) for c in reply.conversations]

    def migrated(self, moves: list[tuple[int, str, int]], attempted: int, failed: int, moved_bytes: int,
                 seconds: float, drained: str = "") -> int:
        """Tell the router where conversations' caches went ((key, replica, tokens) each), and
        which leaving replica's drain is over (``drained``); returns how many moves it applied."""
        request = admin_pb2.MigratedRequest(
            moves=[admin_pb2.Move(key=key, replica=replica, tokens=tokens) for key, replica, tokens in moves],
            attempted=attempted, failed=failed, bytes=moved_bytes, seconds=seconds, drained=drained)
        return int(self._stub.Migrated(request, timeout=self.timeout, metadata=self._metadata).applied)

    def leaving(self, replica: str, seconds: float, near_seconds: float) -> tuple[int, int]:
        """The replica starts leaving (extproc/routing/leaving.py); (idle, in flight) conversations
        the router placed there."""
        request = admin_pb2.LeavingRequest(replica=replica, seconds=seconds, near_seconds=near_seconds)
        reply = self._stub.Leaving(request, timeout=self.timeout, metadata=self._metadata)
        return int(reply.idle), int(reply.in_flight)

    def _call(self, method: Any, request: Any) -> dict[str, Any]:
        try:
            reply = method(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(exc.details()) from None
            raise
        return state_dict(reply)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def state_dict(state: admin_pb2.State) -> dict[str, Any]:
    """Plain Python values (MessageToDict would turn int64 into strings)."""
    routing = state.routing
    return {
        "routing": {key: toml_value(routing.knobs[key]) for key in sorted(routing.knobs)},
        "replicas": [
            {
                "name": replica.name,
                "address": replica.address,
                "healthy": replica.healthy,
                "in_flight_requests": replica.in_flight_requests,
                "in_flight_tokens": replica.in_flight_tokens,
                "leaving": replica.leaving,
            }
            for replica in state.replicas
        ],
        "in_flight_requests": state.in_flight_requests,
        "in_flight_tokens": state.in_flight_tokens,
        "decisions": state.decisions,
    }
