"""The pure parts of a migration: slot files and their manifest, openings, the planner."""

from __future__ import annotations

import itertools
import os
import struct
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from extproc.migration import slotfiles
from extproc.migration.llama import Slot
from extproc.migration.migrate import Outcome, migrate_while_draining
from extproc.migration.openings import Framing, opening_key, opening_keys
from extproc.migration.planner import Candidate, Costs, plan
from extproc.routing.placement import PlacementMemory
from extproc.routing.ring import HashRing
from extproc.service.bodies import _chat
from extproc.service.dataplanes.own_envoy import OWN_ENVOY

IDENTITY = slotfiles.Identity("ab" * 32, 2048, "f16")


def chatml(messages: list[dict[str, str]]) -> str:
    """A ChatML template that adds a default system prompt, as Qwen2's does."""
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": "You are a helpful assistant"}, *messages]
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


def slot_file(path: Path, tokens: list[int], version: int = 4) -> None:
    path.write_bytes(struct.pack("<IIIiII", slotfiles.MAGIC, version, len(tokens) + 4, -1, 1, len(tokens))
                     + struct.pack(f"<{len(tokens)}i", *tokens) + b"kv state")


def test_a_slot_file_is_restorable_only_by_its_own_identity(tmp_path: Path) -> None:
    stem = slotfiles.stem(IDENTITY, 7)
    slot_file(tmp_path / f"{stem}.bin", [1, 2, 3])
    slotfiles.write_manifest(tmp_path, slotfiles.Manifest(IDENTITY, 7, 3, 0.0, "llm-1"))
    assert slotfiles.restorable(tmp_path, IDENTITY, 7) is not None
    for other in (slotfiles.Identity("cd" * 32, 2048, "f16"), slotfiles.Identity("ab" * 32, 4096, "f16"),
                  slotfiles.Identity("ab" * 32, 2048, "q8_0")):
        assert slotfiles.restorable(tmp_path, other, 7) is None
    assert slotfiles.restorable(tmp_path, IDENTITY, 8) is None
    slot_file(tmp_path / f"{stem}.bin", [1, 2])  # torn or replaced: not what the manifest says
    assert slotfiles.restorable(tmp_path, IDENTITY, 7) is None


def test_tokens_are_read_back_and_an_unknown_version_is_no_file(tmp_path: Path) -> None:
    slot_file(tmp_path / "a.bin", [151644, 872, 198])
    assert slotfiles.read_tokens(tmp_path / "a.bin") == [151644, 872, 198]
    slot_file(tmp_path / "b.bin", [1], version=9)
    assert slotfiles.read_tokens(tmp_path / "b.bin") is None
    (tmp_path / "c.bin").write_bytes(b"short")
    assert slotfiles.read_tokens(tmp_path / "c.bin") is None


def test_prune_removes_stale_and_orphaned_files_then_the_oldest_beyond_the_bound(tmp_path: Path) -> None:
    for number, age in enumerate((5000, 300, 200, 100)):
        slot_file(tmp_path / f"{number}.bin", [0] * 100)
        (tmp_path / f"{number}.json").write_text("{}")
        os.utime(tmp_path / f"{number}.bin", (1e6 - age, 1e6 - age))
    slot_file(tmp_path / "orphan.bin", [0])
    (tmp_path / "lonely.json").write_text("{}")
    size = (tmp_path / "1.bin").stat().st_size
    removed = slotfiles.prune(tmp_path, max_bytes=2 * size, max_age_seconds=3600, now=1e6)
    assert sorted(p.name for p in removed) == ["0.bin", "1.bin", "orphan.bin"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["2.bin", "2.json", "3.bin", "3.json"]


def test_a_slots_text_gives_the_opening_key_the_service_computes_from_the_body() -> None:
    framing = Framing.learn(chatml)
    for messages in ([{"role": "user", "content": "Tell me about the harbour."}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi\nthere"}]):
        answered = [*messages, {"role": "assistant", "content": "Sure."}, {"role": "user", "content": "More"}]
        slot_text = chatml(answered) + "It was"  # a slot holds its last prompt and the answer begun
        assert _chat(answered, None)[0] in opening_keys(slot_text, framing)
    assert opening_keys("no template here", framing) == set()


@given(st.text(min_size=1, max_size=80).filter(lambda t: "<|im_end|>" not in t))
def test_any_user_text_survives_the_round_trip(text: str) -> None:
    slot_text = chatml([{"role": "user", "content": text}])
    assert opening_key([("user", text)]) in opening_keys(slot_text, Framing.learn(chatml))


def test_the_plan_moves_recent_long_conversations_home_first_within_free_slots_and_budget() -> None:
    ring = HashRing(["a", "b"], 64, 0)
    costs = Costs(bytes_per_token=1000, prefill_seconds_per_token=0.01, transfer_bytes_per_second=1e9)
    candidates = [Candidate(key, slot, tokens, task) for key, slot, tokens, task in
                  ((11, 0, 500, 5), (22, 1, 10, 9), (33, 2, 800, 7), (44, 3, 600, 1))]
    moves = plan(candidates, ring, {"a": 1, "b": 1}, costs, min_tokens=64, max_bytes=10**9)
    assert [m.conversation_key for m in moves] == [33, 11]  # 22 too short, 44 found no slot left
    assert moves[0].receiver == next(ring.walk(33))
    assert {m.receiver for m in moves} == {"a", "b"}
    tight = plan(candidates, ring, {"a": 4, "b": 4}, costs, min_tokens=64, max_bytes=900_000)
    assert [m.conversation_key for m in tight] == [33]
    slow = Costs(1000, 1e-6, 1e3)  # moving costs more than computing again
    assert plan(candidates, ring, {"a": 4, "b": 4}, slow, 0, 10**9) == []


@given(st.lists(st.tuples(st.integers(0, 2**64 - 1), st.sampled_from("abc"), st.integers(0, 10**6)), max_size=60))
def test_placed_on_lists_exactly_the_remembered_conversations_last_on_a_replica(entries: list) -> None:
    memory = PlacementMemory(capacity=1000)
    last: dict[int, tuple[str, int]] = {}
    for key, replica, tokens in entries:
        memory.remember(key, replica, tokens)
        last[key] = (replica, tokens)
    for replica in "abc":
        expected = sorted((k, t) for k, (r, t) in last.items() if r == replica)
        assert sorted(memory.placed_on(replica)) == expected
    assert memory.placed_on("never") == []


def test_the_router_lists_what_a_leaving_replica_served_and_marks_a_migrated_conversations_next_turn() -> None:
    from extproc.routing import Router, RouteRequest
    from extproc.settings import load_settings

    router = Router(load_settings("extproc/service/router.toml", environ={}).routing, ["a", "b", "c"])
    done = router.route(RouteRequest("1", "done", 400, 8)).decision
    router.complete("1")
    serving = router.route(RouteRequest("2", "serving", 300, 8)).decision
    leaving = done.replica
    router.set_replicas([n for n in "abc" if n != leaving])
    keys = dict(router.placed_on(leaving))
    assert keys[router.conversation_key("done")] == 400
    if serving.replica == leaving:  # in flight when its replica left: listed too
        assert keys[router.conversation_key("serving")] == 300
    receiver = next(n for n in "abc" if n != leaving)
    assert not router.migrated(router.conversation_key("done"), leaving, 400)  # not a member
    assert router.migrated(router.conversation_key("done"), receiver, 400)
    after = router.route(RouteRequest("3", "done", 420, 8)).decision
    assert after.replica == receiver and after.reason.endswith("+migrated")
    router.complete("3")
    again = router.route(RouteRequest("4", "done", 440, 8)).decision
    assert "migrated" not in again.reason  # only the first decision after the move
    router.set_replicas("abc")  # back as a fresh server: nothing is cached there
    assert router.placed_on(leaving) == []


ROLL_EVENTS = ("migrated", "released", "left", "rejoined")  # after the turn it moves is routed


@pytest.mark.parametrize("order", [order for order in itertools.permutations(ROLL_EVENTS)
                                   if order.index("left") < order.index("rejoined")], ids="-".join)
def test_a_migrated_conversations_next_turn_goes_to_the_receiver_whatever_the_order_of_a_roll(
        order: tuple[str, ...]) -> None:
    """A roll reports the move while the turn's answer may still be streaming (its release comes
    later: the stream's end, or the next turn's body), and the replica leaves and rejoins around
    them. The receiver holds the cache in every order; the rejoined source holds nothing."""
    from extproc.routing import Router, RouteRequest
    from extproc.settings import load_settings

    router = Router(load_settings("extproc/service/router.toml", environ={}).routing, ["llm-0", "llm-1"])
    chat = next(f"chat-{i}" for i in range(100) if router.ring.home(router.conversation_key(f"chat-{i}")) == "llm-0")
    router.route(RouteRequest("1", chat, 40, 8)).release()
    turn = router.route(RouteRequest("2", chat, 83, 8))
    assert turn.decision.replica == "llm-0"
    events = {"migrated": lambda: router.migrated(router.conversation_key(chat), "llm-1", 90),
              "released": turn.release,
              "left": lambda: router.set_replicas(["llm-1"]),
              "rejoined": lambda: router.set_replicas(["llm-0", "llm-1"])}
    for event in order:
        events[event]()
    after = router.route(RouteRequest("3", chat, 100, 8)).decision
    assert (after.replica, after.reason, after.predicted_cached_tokens) == ("llm-1", "sticky+migrated", 90)


def test_a_migration_points_the_prefix_index_at_the_receiver_even_while_the_source_still_serves() -> None:
    from extproc.routing import Router, RouteRequest
    from extproc.routing.settings import with_knobs
    from extproc.settings import load_settings, parse_routing

    base = load_settings("extproc/service/router.toml", environ={}).routing.table()
    settings = parse_routing(with_knobs(base, {"policy": "llm-aware", "prefix_index": True}))
    blocks = tuple(range(1000, 1040))  # 40 blocks of 16 tokens

    def follow_up(moved_blocks: tuple[int, ...]) -> tuple[str, str, str, int]:
        router = Router(settings, ["a", "b", "c"])
        first = router.route(RouteRequest("1", "chat", 640, 8, blocks)).decision
        router.complete("1")
        receiver = next(n for n in "abc" if n != first.replica)
        assert router.migrated(router.conversation_key("chat"), receiver, 648, moved_blocks)
        then = router.route(RouteRequest("2", "chat", 700, 8, (*blocks, 2000, 2001, 2002))).decision
        return first.replica, receiver, then.replica, then.predicted_cached_tokens

    source, receiver, went, cached = follow_up(blocks)
    assert went == receiver and cached >= 600  # the receiver holds the history, the source does not count
    source, receiver, went, _ = follow_up(())  # not told the blocks: the index still sees them on the source
    assert went == source


def test_a_reused_conversation_id_is_listed_with_its_own_opening_after_a_reset() -> None:
    """A run that reuses the ids of an earlier one: each chat is routed under a key of its own
    (it does not continue the earlier chat), and Placements must give that key its opening, or
    no slot can be traced back to it."""
    import asyncio

    import orjson

    from extproc.service import admin_pb2
    from extproc.service.admin import AdminService
    from tests.service.test_gateway_lifecycle import ENDPOINTS, make_gateway

    gateway = make_gateway()

    def turn(messages: list[dict[str, str]]) -> str:
        _, routed = gateway.route_request(shape=OWN_ENVOY, path="/v1/chat/completions", content_type="application/json",
                                          session_headers={"x-conversation-id": "c-1"}, turn="", request_id="envoy-id",
                                          body=orjson.dumps({"messages": messages, "max_tokens": 8}))
        assert routed
        request_id = next(reversed(gateway.requests.pending))
        replica = gateway.requests.pending[request_id].decision.replica
        gateway.requests.access_logged(request_id, 200, ENDPOINTS[replica], cut_off=False, timings=None)
        return replica

    first = [{"role": "user", "content": "an earlier run's chat"}]
    turn(first)
    turn([*first, {"role": "assistant", "content": "sure"}, {"role": "user", "content": "go on"}])
    gateway.router.reset()  # between runs: the gateway still knows c-1's last history
    replica = turn([{"role": "user", "content": "this run's chat"}])
    reply = asyncio.run(AdminService(gateway).Placements(admin_pb2.PlacementsRequest(replica=replica), None))
    (listed,) = reply.conversations
    assert listed.opening == opening_key([("user", "this run's chat")])


@pytest.mark.parametrize("model", ["", "smollm2"])
def test_a_migrated_conversation_of_a_named_model_follows_its_cache_to_the_receiver(model: str) -> None:
    """Migrated tells the prefix index which blocks moved, found under the key the request's
    blocks were remembered by (its model and opening): else the index still sees the history on
    the source, and llm-aware sends the next turn there, cold, however the placement was moved."""
    import asyncio

    import orjson

    from extproc.service import admin_pb2
    from extproc.service.admin import AdminService
    from tests.service.test_gateway_lifecycle import ENDPOINTS, make_gateway

    gateway = make_gateway()
    messages = [{"role": "user", "content": "the harbour and its ships, " * 60}]

    def turn() -> tuple[str, str]:
        body = {"messages": messages, "max_tokens": 8} | ({"model": model} if model else {})
        gateway.route_request(shape=OWN_ENVOY, path="/v1/chat/completions", content_type="application/json",
                              session_headers={"x-conversation-id": "c-1"}, turn="", request_id="envoy-id",
                              body=orjson.dumps(body))
        request_id = next(reversed(gateway.requests.pending))
        decision = gateway.requests.pending[request_id].decision
        gateway.requests.access_logged(request_id, 200, ENDPOINTS[decision.replica], cut_off=False, timings=None)
        messages.extend([{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "and then?"}])
        return decision.replica, decision.reason

    source, _ = turn()
    receiver = next(name for name in ENDPOINTS if name != source)
    (placed,) = asyncio.run(AdminService(gateway).Placements(admin_pb2.PlacementsRequest(replica=source),
                                                             None)).conversations
    move = admin_pb2.Move(key=placed.key, replica=receiver, tokens=placed.prompt_tokens)
    asyncio.run(AdminService(gateway).Migrated(admin_pb2.MigratedRequest(moves=[move]), None))
    went, reason = turn()
    assert (went, reason.endswith("+migrated")) == (receiver, True), reason


@pytest.mark.parametrize("ended_by", ["its access log", "the next turn's body"])
def test_a_turn_whose_answer_ends_after_its_move_leaves_the_next_turn_to_the_receiver(ended_by: str) -> None:
    """The service's order in a roll: the slot of a turn answered whole is moved and the move
    reported (Migrated) before Envoy ends that turn's request; the next turn goes to the receiver."""
    import asyncio

    import orjson

    from extproc.service import admin_pb2
    from extproc.service.admin import AdminService
    from tests.service.test_gateway_lifecycle import ENDPOINTS, make_gateway

    gateway = make_gateway()

    def routed(messages: list[dict[str, str]]) -> str:
        _, request_id = gateway.route_request(shape=OWN_ENVOY,
                                              path="/v1/chat/completions", content_type="application/json",
                                              session_headers={"x-conversation-id": "c-1"}, turn="",
                                              request_id="envoy-id",
                                              body=orjson.dumps({"messages": messages, "max_tokens": 8}))
        assert request_id is not None
        return request_id

    def ended(request_id: str) -> None:
        replica = gateway.requests.pending[request_id].decision.replica
        gateway.requests.access_logged(request_id, 200, ENDPOINTS[replica], cut_off=False, timings=None)

    history = [{"role": "user", "content": "an opening question"}]
    ended(routed(history))
    history += [{"role": "assistant", "content": "an answer"}, {"role": "user", "content": "a second question"}]
    second = routed(history)
    source = gateway.requests.pending[second].decision.replica
    receiver = next(name for name in sorted(ENDPOINTS) if name != source)
    move = admin_pb2.Move(key=gateway.router.conversation_key("c-1"), replica=receiver, tokens=40)
    reply = asyncio.run(AdminService(gateway).Migrated(admin_pb2.MigratedRequest(moves=[move], attempted=1), None))
    assert reply.applied == 1
    if ended_by == "its access log":
        ended(second)
    history += [{"role": "assistant", "content": "another answer"}, {"role": "user", "content": "and then?"}]
    ticket = gateway.requests.pending[second].ticket if second in gateway.requests.pending else None
    decision = gateway.requests.pending[routed(history)].decision
    assert ticket is None or not ticket.held  # released: by its access log, or as the next body shows it answered
    assert decision.replica == receiver and decision.reason.endswith("+migrated"), decision.trace


class ScriptedSlots:
    """A leaving replica's slots as successive reads return them."""

    def __init__(self, reads: list[list[Slot]]) -> None:
        self.reads = reads

    def slots(self) -> list[Slot]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]


def test_a_drain_pass_whose_slot_turned_busy_waits_for_it_and_one_that_failed_stops() -> None:
    """The idle slot seen is taken by a follow-up before the pass saves it: nothing saved, no
    problem; the drain waits for that request's end and moves the slot then."""
    idle, busy, later = Slot(0, 300, False, 5), Slot(0, 300, True, 6), Slot(0, 340, False, 6)
    source = ScriptedSlots([[idle], [busy], [busy], [later]])
    passes: list[frozenset[tuple[int, int]]] = []

    def migrate_pass(saved: frozenset[tuple[int, int]]) -> Outcome:
        passes.append(saved)
        outcome = Outcome("llm-1")
        if len(passes) > 1:  # the first found the slot busy; the second saves its later state
            outcome.saved_slots.append((0, 6))
        return outcome

    total = migrate_while_draining(source, time.monotonic() + 10, migrate_pass, Outcome("llm-1"))
    assert passes == [frozenset(), frozenset()] and total.saved_slots == [(0, 6)]

    def failing(saved: frozenset[tuple[int, int]]) -> Outcome:
        passes.append(saved)
        return Outcome("llm-1", problems=["router 127.0.0.1:1: RpcError"])

    passes.clear()
    total = migrate_while_draining(ScriptedSlots([[idle]]), time.monotonic() + 10, failing, Outcome("llm-1"))
    assert len(passes) == 1 and total.problems == ["router 127.0.0.1:1: RpcError"]
