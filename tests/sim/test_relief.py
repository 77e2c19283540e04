"""Hot-spot relief in the simulator: a turn routed away from the replica holding its cache takes
the cache along when moving it is quicker than computing it, and waits for the transfer."""

from __future__ import annotations

from extproc.sim.costmodel import load_cost_model
from extproc.sim.relief import Relief, held_tokens
from extproc.sim.replica import Replica
from extproc.sim.request import Request


def turns(prompt: int) -> tuple[Request, Request]:
    first = Request("r1", "chat", 1, "chat", None, prompt, 8)
    later = Request("r2", "chat", 2, "chat", None, prompt + 40, 8)
    return first, later


def fleet() -> dict[str, Replica]:
    cost = load_cost_model("smollm2-135m")
    return {name: Replica(name, cost, 2, 100_000) for name in ("llm-0", "llm-1")}


def served(replicas: dict[str, Replica], relief: Relief, first: Request) -> None:
    """``first`` routed to and served by llm-0: its slot holds the prompt."""
    assert relief.move(replicas, first, replicas["llm-0"]) == 0.0  # a first turn has nothing to move
    first.replica, first.status = "llm-0", 200
    slot = replicas["llm-0"].slots[0]
    slot.key, slot.blocks, slot.tokens = first.key, first.blocks, first.prompt_tokens


def test_a_turn_sent_away_from_its_cache_takes_it_along_and_waits_for_the_transfer() -> None:
    replicas, relief = fleet(), Relief(1e9, 64)
    first, later = turns(800)
    served(replicas, relief, first)
    target = replicas["llm-1"]
    assert held_tokens(target, later) == 0
    wait = relief.move(replicas, later, target)
    assert 0 < wait < target.cost.prefill_s(800, 0)
    assert wait == 800 * target.cost.kv_bytes_per_token / 1e9
    assert target.cache.take_best("chat", None, 840, -1.0, 0.0) == ("chat", None, 800)
    assert (relief.moves, relief.moved_bytes) == (1, 800 * target.cost.kv_bytes_per_token)


def test_nothing_moves_to_the_replica_that_holds_it_nor_when_computing_is_quicker() -> None:
    replicas, relief = fleet(), Relief(1e9, 64)
    first, later = turns(800)
    served(replicas, relief, first)
    assert relief.move(replicas, later, replicas["llm-0"]) == 0.0  # sticky: already there
    slow, (first, later) = Relief(1.0, 64), turns(800)  # 1 byte/s
    served(replicas, slow, first)
    assert slow.move(replicas, later, replicas["llm-1"]) == 0.0 and slow.moves == 0
    short, (first, later) = Relief(1e9, 64), turns(40)  # under min_tokens
    replicas = fleet()
    served(replicas, short, first)
    assert short.move(replicas, later, replicas["llm-1"]) == 0.0
