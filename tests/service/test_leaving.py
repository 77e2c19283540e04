"""The routing service while a replica leaves (Admin Leaving, extproc/service/leaving.py): no new
conversation goes there, its unmoved conversations' follow-ups still do, a moved one's go to its
receiver only; each decision's phase is in the trace, the replica's phases when it is dropped."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from extproc.service import admin_pb2
from extproc.service.admin import AdminService
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.gateway import Gateway
from tests.service.test_gateway_lifecycle import ENDPOINTS, make_gateway


class Chats:
    def __init__(self) -> None:
        self.gateway = make_gateway()
        self.logged: list[dict[str, Any]] = []
        self.gateway.decision_log = self.logged.append
        self.histories: dict[str, list[dict[str, str]]] = {}

    def send(self, conversation: str) -> str:
        """The conversation's next turn routed; its request id."""
        history = self.histories.setdefault(conversation, [])
        if history:
            history.append({"role": "assistant", "content": "an answer"})
        history.append({"role": "user", "content": f"{conversation}: question {len(history)}"})
        _, request_id = self.gateway.route_request(
            shape=OWN_ENVOY, path="/v1/chat/completions", content_type="application/json",
            session_headers={"x-conversation-id": conversation}, turn="",
            request_id=f"envoy-{conversation}-{len(history)}",
            body=orjson.dumps({"messages": history, "max_tokens": 8}))
        assert request_id is not None
        return request_id

    def end(self, request_id: str) -> str:
        """Its access log: served where it was sent; that replica."""
        replica = self.gateway.requests.pending[request_id].decision.replica
        self.gateway.requests.access_logged(request_id, 200, ENDPOINTS[replica], cut_off=False, timings=None)
        return replica

    def admin(self, method: str, request: Any) -> Any:
        return asyncio.run(getattr(AdminService(self.gateway), method)(request, None))


def placed(chats: Chats, replica: str, prefix: str) -> str:
    """A conversation whose first turn went to `replica` and ended there."""
    for i in range(200):
        request_id = chats.send(f"{prefix}-{i}")
        if chats.end(request_id) == replica:
            return f"{prefix}-{i}"
    raise AssertionError(f"no conversation went to {replica}")


def leaving_phases(gateway: Gateway, logged: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return [(f["leaving_phase"], f["replica"]) for f in logged if "leaving_phase" in f]


def test_a_leaving_replica_keeps_its_conversations_until_they_move_and_takes_no_new_one() -> None:
    chats = Chats()
    idle, busy = placed(chats, "llm-1", "idle"), placed(chats, "llm-1", "busy")
    in_flight = chats.send(busy)
    assert chats.gateway.requests.pending[in_flight].decision.replica == "llm-1"
    reply = chats.admin("Leaving", admin_pb2.LeavingRequest(replica="llm-1", seconds=60, near_seconds=10))
    assert (reply.idle, reply.in_flight) == (1, 1)

    new = [chats.gateway.requests.pending[chats.send(f"new-{i}")].decision.replica for i in range(30)]
    assert "llm-1" not in new  # without the order, a third of them would go there
    follow_up = chats.send(idle)
    assert chats.end(follow_up) == "llm-1"  # still serving, its cache there

    key = chats.gateway.router.conversation_key(idle)
    chats.admin("Migrated", admin_pb2.MigratedRequest(moves=[admin_pb2.Move(key=key, replica="llm-2", tokens=40)]))
    assert chats.end(chats.send(idle)) == "llm-2"
    assert chats.end(in_flight) == "llm-1"

    chats.gateway.set_replicas({n: a for n, a in ENDPOINTS.items() if n != "llm-1"})
    assert leaving_phases(chats.gateway, chats.logged)[-2:] == [("before move", "llm-1"), ("after move", "llm-2")]
    (left,) = [f for f in chats.logged if f.get("event") == "replica_left"]
    assert [e[2:] for e in left["events"]] == [["moved", "llm-2"], ["unmoved at deadline", "llm-1"]]
    assert left["unmoved"] == [chats.gateway.router.conversation_key(busy)]
    assert [f[2:] for f in left["follow_ups"]] == [["before move", "llm-1"], ["after move", "llm-2"]]


def test_leaving_an_unknown_replica_is_refused() -> None:
    chats = Chats()

    class Context:
        async def abort(self, code: Any, message: str) -> None:
            raise ValueError(message)

    with pytest.raises(ValueError, match="llm-9"):
        asyncio.run(AdminService(chats.gateway).Leaving(admin_pb2.LeavingRequest(replica="llm-9", seconds=60),
                                                        Context()))  # type: ignore[arg-type]


def test_a_drained_replica_takes_nothing_more_while_it_is_still_listed() -> None:
    """A pod's slot sidecar says its drain is over before llama-server stops: from then on no
    request goes there, not even a follow-up whose cache was left there (computed elsewhere);
    the order's phases are logged once, when discovery drops the replica."""
    chats = Chats()
    unmoved, moved = placed(chats, "llm-1", "unmoved"), placed(chats, "llm-1", "moved")
    chats.admin("Leaving", admin_pb2.LeavingRequest(replica="llm-1", seconds=60, near_seconds=10))
    key = chats.gateway.router.conversation_key(moved)
    chats.admin("Migrated", admin_pb2.MigratedRequest(moves=[admin_pb2.Move(key=key, replica="llm-2", tokens=40)]))
    chats.admin("Migrated", admin_pb2.MigratedRequest(drained="llm-9"))  # not leaving: nothing changes
    assert chats.end(chats.send(unmoved)) == "llm-1"

    chats.admin("Migrated", admin_pb2.MigratedRequest(drained="llm-1"))
    assert "llm-1" in chats.gateway.fleet.endpoints
    assert chats.end(chats.send(unmoved)) != "llm-1"
    assert chats.end(chats.send(moved)) == "llm-2"
    assert "llm-1" not in {chats.end(chats.send(f"new-{i}")) for i in range(30)}
    assert not [f for f in chats.logged if f.get("event") == "replica_left"]

    chats.gateway.set_replicas({n: a for n, a in ENDPOINTS.items() if n != "llm-1"})
    (left,) = [f for f in chats.logged if f.get("event") == "replica_left"]
    assert left["down_s"] is not None and left["unmoved"] == [chats.gateway.router.conversation_key(unmoved)]
    assert [f[2] for f in left["follow_ups"]] == ["before move", "after down", "after down"]
    assert [f[3] == "llm-1" for f in left["follow_ups"]] == [True, False, False]
