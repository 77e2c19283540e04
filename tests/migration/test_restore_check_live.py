"""A restore's check against a real llama.cpp replica with a host-RAM prompt cache: it runs the
restored tokens as the next turn would, not pinned to a slot, so llama.cpp #28139 (a request
pinned with id_slot to an empty slot skips the host-RAM cache) cannot make it report a miss."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from extproc.migration import slotfiles
from extproc.migration.llama import LlamaServer
from extproc.migration.migrate import _restore
from extproc.migration.planner import Move
from extproc.stack import replicas as stack_replicas
from extproc.stack.daemons import stop
from extproc.stack.models import smollm2_gguf
from extproc.stack.ports import free_port

pytestmark = pytest.mark.live
A, B = list(range(1000, 1290)), list(range(3000, 3200))  # two prompts sharing nothing


@pytest.fixture(scope="module")
def replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LlamaServer, Path]]:
    """One replica as the stack runs them: 2 slots, a 256 MiB host-RAM prompt cache."""
    run = tmp_path_factory.mktemp("replica")
    settings = stack_replicas.ReplicaSettings(backend="xllamacpp", model=str(smollm2_gguf()), ctx_size=2048,
                                              parallel=2, threads=1, cache_ram_mib=256, slot_prompt_similarity=0.5)
    started = stack_replicas.start({"llm-0": free_port()}, settings, run)
    try:
        stack_replicas.wait_healthy(started, timeout=120, progress=lambda _: None)
        yield LlamaServer(started[0].address, 120, stack_replicas.api_key(run)), stack_replicas.slot_folder(run)
    finally:
        stop([r.process for r in started])


def run_pinned(server: LlamaServer, tokens: list[int], slot: int) -> int:
    reply = server._call("POST", "/completion", {"prompt": tokens, "n_predict": 0, "cache_prompt": True,
                                                 "id_slot": slot})
    return int(reply["timings"]["cache_n"])


def test_the_check_finds_a_prompt_held_only_in_the_host_ram_cache(replica: tuple[LlamaServer, Path]) -> None:
    server, _ = replica
    first, _ = server.held(A)
    run_pinned(server, B, first)  # B takes A's slot: A is now in the host-RAM cache only
    assert all(s.tokens != len(A) for s in server.slots())
    _, cached = server.held(A)
    assert cached >= len(A) - 1  # what the next turn finds; pinned to the empty slot it would be 0


def test_a_restore_into_an_empty_slot_is_found_by_its_check(replica: tuple[LlamaServer, Path]) -> None:
    server, folder = replica
    slot, _ = server.held(A)
    server.save(slot, "a.bin")
    assert slotfiles.read_tokens(folder / "a.bin") == A
    for s in server.slots():
        server.erase(s.id)
    empty = next(s.id for s in server.slots() if s.tokens == 0)
    assert _restore(Move(1, 0, "llm-0", len(A), 0, 1.0), server, empty, ("a.bin", len(A)), A) is None
