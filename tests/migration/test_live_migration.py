"""Migration through the real parts: 3 xllamacpp replicas of the tiny model, the routing
service and Envoy. A conversation whose replica leaves continues on another replica with its
history cached; a slot file for another model is a clean miss. In file order, one stack."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.migration import slotfiles
from extproc.migration.llama import LlamaServer, key_headers
from extproc.migration.migrate import Limits, Outcome, SharedFolder, Transport, migrate_out
from extproc.migration.planner import Costs
from extproc.service.admin_client import AdminClient
from extproc.stack import models
from extproc.stack.lab import LocalLab
from extproc.stack.replicas import api_key, slot_folder
from extproc.stack.settings import load_stack_settings
from tests.stack.test_live_stack import FREE_PORTS, Chat, conversation_homed_on

pytestmark = pytest.mark.live
NAMES = ["llm-0", "llm-1", "llm-2"]
TURNS = ("Tell me about the old harbour of the city, its ships, its trade and the people on its quays.",
         "What happened there in the long winter when the river froze?")


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalLab]:
    models.prepare("tiny", models.data_dir(), progress=lambda _: None)
    settings = load_stack_settings(overrides={
        "replicas": {"count": 3, "model": "tiny", "ctx_size": 4096, "parallel": 2, "cache_ram_mib": 0},
        "ports": FREE_PORTS,
        "router": {"policy": "llm-aware"},
        "check": {"profile": "quick"},
        "migration": {"min_tokens": 16, "drain_seconds": 30},
    })
    with LocalLab.start(settings, run=tmp_path_factory.mktemp("stack"), progress=lambda _: None) as running:
        yield running


def key(lab: LocalLab) -> str:
    """The API key the stack's replicas want."""
    return api_key(Path(lab.stack.state.run_dir))


def talk(lab: LocalLab, conversation: str) -> tuple[Chat, int]:
    chat = Chat(lab.gateway_url, conversation)
    for text in (f"{conversation}: {TURNS[0]}", TURNS[1]):
        reply, answer = chat.turn(text)
        assert reply.status_code == 200, reply.text
    return chat, answer["timings"]["cache_n"] + answer["timings"]["prompt_n"]


def test_chats_that_open_alike_keep_a_slot_each_which_a_migration_can_move(lab: LocalLab) -> None:
    """replicas.slot_prompt_similarity 0.5: at llama.cpp's 0.1 the second chat takes the first's
    slot (the template's default system prompt is most of a short opening) and the first is lost
    (no host-RAM cache here), or held only there, which no migration moves."""
    for prefix in ("alike-a", "alike-b"):
        talk(lab, conversation_homed_on(lab, "llm-1", NAMES, prefix))
    replica = LlamaServer(next(r.address for r in lab.stack.replica_list if r.name == "llm-1"), key=key(lab))
    assert [slot.tokens > 0 for slot in replica.slots()] == [True, True]


def move_out(lab: LocalLab, staying: list[str], done: frozenset[tuple[int, int]] = frozenset(),
             receiver_identity: slotfiles.Identity | None = None, transport: Transport | None = None) -> Outcome:
    """llm-2's conversations moved to `staying` (llm-2 stays in the lists)."""
    stack = lab.stack
    ours = slotfiles.Identity(stack.model_of("llm-0").sha256, stack.replica_settings().slot_context, "f16")
    addresses = {r.name: r.address for r in stack.replica_list}
    folder = slot_folder(Path(stack.state.run_dir))
    return migrate_out(("llm-2", addresses["llm-2"]), {name: addresses[name] for name in staying},
                       [stack.state.router_address], folder, ours,
                       transport or SharedFolder(folder, dict.fromkeys(staying, receiver_identity or ours)),
                       Costs(4096, 0.01, 1e9),
                       Limits(16, 2**30, 3600, 2**30), time.monotonic() + 30, done=done, replica_key=key(lab))


def test_a_second_pass_into_one_replica_restores_beside_the_first_and_both_continue_cached(lab: LocalLab) -> None:
    chats, done = [], frozenset[tuple[int, int]]()
    for prefix in ("first-pass", "second-pass"):
        chat, held = talk(lab, conversation_homed_on(lab, "llm-2", NAMES, prefix))
        outcome = move_out(lab, ["llm-0"], done)
        assert len(outcome.moved) == 1, outcome
        done |= frozenset(outcome.saved_slots)
        chats.append((chat, held))
    receiver = LlamaServer(next(r.address for r in lab.stack.replica_list if r.name == "llm-0"), key=key(lab))
    assert sorted(slot.tokens > 0 for slot in receiver.slots()) == [True, True]  # each restore listed in its slot
    for chat, held in chats:  # straight to the receiver: llm-2 stays in the lists here, routing is not the point
        body = {"messages": [*chat.history, {"role": "user", "content": "And who lives there now?"}], "max_tokens": 8}
        answer = httpx.post(f"http://{receiver.address}/v1/chat/completions", json=body, timeout=60,
                            headers=key_headers(key(lab))).json()
        assert answer["timings"]["cache_n"] >= held - 1, chat.conversation


def test_a_slot_file_of_another_model_is_a_clean_miss(lab: LocalLab) -> None:
    conversation = conversation_homed_on(lab, "llm-2", NAMES, "other-model")
    talk(lab, conversation)
    other = slotfiles.Identity("0" * 64, lab.stack.replica_settings().slot_context, "f16")  # serves another model
    with AdminClient(lab.stack.state.router_address) as admin:
        placed = {key for key, _, _ in admin.placements("llm-2")}
        outcome = move_out(lab, ["llm-0", "llm-1"], receiver_identity=other)
        assert outcome.matched >= 1 and outcome.attempted >= 1
        assert outcome.moved == [] and outcome.failed == outcome.attempted
        assert any("a miss" in problem for problem in outcome.problems)
        # no router was told of a move that could not be delivered: the conversations stay placed
        assert placed and {key for key, _, _ in admin.placements("llm-2")} == placed


class LostOnTheWay:
    """A file that reaches no receiver: each restore fails."""

    def deliver(self, receiver: str, conversation_key: int) -> tuple[str, int] | None:
        return "no-such-slot-file.bin", 100


def test_a_restore_that_fails_is_never_told_to_the_routers(lab: LocalLab) -> None:
    """The routers hear of a move only once its copy is in place and checked: until then the
    conversation's next turn goes to the leaving replica, which still holds it."""
    talk(lab, conversation_homed_on(lab, "llm-2", NAMES, "restore-fails"))
    with AdminClient(lab.stack.state.router_address) as admin:
        placed = {key for key, _, _ in admin.placements("llm-2")}
        outcome = move_out(lab, ["llm-0", "llm-1"], transport=LostOnTheWay())
        assert outcome.attempted >= 1 and outcome.moved == [] and outcome.failed == outcome.attempted, outcome
        assert placed and {key for key, _, _ in admin.placements("llm-2")} == placed


def test_a_conversation_whose_replica_leaves_continues_elsewhere_with_its_history_cached(lab: LocalLab) -> None:
    conversation = conversation_homed_on(lab, "llm-2", NAMES, "leaving")
    chat, held = talk(lab, conversation)
    (step,) = lab.stack.scale(2, progress=lambda _: None)
    outcome = step["migration"]
    assert step["replica"] == "llm-2" and step["out"] <= step["drained"] <= step["down"]
    assert outcome["succeeded"] >= 1, outcome
    reply, answer = chat.turn("And who lives there now?")
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-routed-to"] in ("llm-0", "llm-1")
    assert "migrated" in reply.headers["x-route-reason"], (outcome, reply.headers["x-routed-to"])
    assert answer["timings"]["cache_n"] >= held - 1  # the whole history (less the last sampled token)
    with AdminClient(lab.stack.state.router_address) as admin:
        assert admin.state()["replicas"] and len(admin.state()["replicas"]) == 2
    metrics = __import__("httpx").get(lab.stack.state.metrics_url).text
    assert 'llm_ring_migrations_total{outcome="succeeded"}' in metrics


def test_a_rolling_restart_of_a_replica_keeps_its_conversation_cached_and_records_the_times(lab: LocalLab) -> None:
    conversation = conversation_homed_on(lab, "llm-0", NAMES[:2], "rolled")
    chat, held = talk(lab, conversation)
    step = lab.roll("llm-0", migrate=True)
    assert step["replica"] == "llm-0" and step["down"] < step["up"]
    assert step["migration"]["succeeded"] >= 1, step
    assert sorted(lab.stack.healthy_replicas()) == ["llm-0", "llm-1"]
    reply, answer = chat.turn("And who lives there now?")
    assert reply.headers["x-routed-to"] == "llm-1" and "migrated" in reply.headers["x-route-reason"], (
        reply.headers["x-routed-to"], reply.headers["x-route-reason"], str(step["migration"]))
    assert answer["timings"]["cache_n"] >= held - 1
