"""The peer policies' views stay bounded and agree with a plain model; block hashes are
stable across processes; chwbl never exceeds its bound."""

from __future__ import annotations

import os
import subprocess
import sys

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing import Router, RouteRequest
from extproc.routing.blocks import BLOCK_CHARS, prefix_blocks
from extproc.routing.prefix_views import ActiveBlocks, BlockIndex
from tests.routing.conftest import routing

NAMES = ["llm-0", "llm-1", "llm-2"]
sends = st.lists(st.tuples(st.sampled_from(NAMES), st.lists(st.integers(0, 30), max_size=12)), max_size=40)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), sends)
def test_block_index_keeps_at_most_capacity_per_replica_the_most_recently_sent(capacity: int, log) -> None:
    index = BlockIndex(capacity)
    model: dict[str, list[int]] = {name: [] for name in NAMES}  # least recent first
    for replica, blocks in log:
        index.add(replica, blocks)
        for block in blocks:
            if block in model[replica]:
                model[replica].remove(block)
            model[replica].append(block)
        del model[replica][:-capacity]
        assert all(index.size(name) == len(model[name]) <= capacity for name in NAMES)
    for block in range(31):
        assert set(index.holders(block)) == {name for name in NAMES if block in model[name]}
    for _, blocks in log:  # the walks agree with the plain model
        leading = index.leading_matches(blocks)
        for name in NAMES:
            run = next((depth for depth, block in enumerate(blocks) if block not in model[name]), len(blocks))
            assert leading.get(name, 0) == index.held_prefix(name, blocks) == run
        depth, counts = index.matches(blocks)
        assert depth == index.depth(blocks) == next(
            (d for d, block in enumerate(blocks) if not any(block in model[name] for name in NAMES)), len(blocks))
        assert dict(counts) == {name: n for name in NAMES if (n := sum(b in model[name] for b in blocks[:depth]))}
    index.set_replicas(["llm-1"])
    assert index.size("llm-0") == index.size("llm-2") == 0
    assert all(set(index.holders(block)) <= {"llm-1"} for block in range(31))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(NAMES), st.lists(st.integers(0, 20), max_size=8, unique=True),
                          st.integers(0, 500)), max_size=25), st.data())
def test_active_blocks_count_distinct_blocks_of_requests_in_flight(requests, data) -> None:
    active = ActiveBlocks()
    live: dict[str, tuple[str, tuple[int, ...], int]] = {}
    for number, (replica, blocks, prefill) in enumerate(requests):
        active.add(str(number), replica, tuple(blocks), prefill)
        live[str(number)] = (replica, tuple(blocks), prefill)
        if live and data.draw(st.booleans()):
            gone = data.draw(st.sampled_from(sorted(live)))
            active.remove(gone)
            active.remove(gone)  # twice: nothing more
            del live[gone]
        for name in NAMES:
            mine = [entry for entry in live.values() if entry[0] == name]
            assert active.blocks().get(name, 0) == len({block for _, blocks, _ in mine for block in blocks})
            assert active.prefill_tokens().get(name, 0) == sum(prefill for _, _, prefill in mine)
    for request_id in list(live):
        active.remove(request_id)
    assert active.in_flight() == 0 and active.shared(range(21)) == {}
    assert all(active.blocks().get(name, 0) == active.prefill_tokens().get(name, 0) == 0 for name in NAMES)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(NAMES + ["llm-3"]), max_size=30), st.text(min_size=1, max_size=200),
       st.sets(st.sampled_from(NAMES + ["llm-3"]), max_size=3))
def test_chwbl_never_picks_above_its_bound(loads, opening, avoid) -> None:
    """KubeAI chwblLoadOK: the pick's load before the request is <= (total + 1) / n x 1.25,
    and every replica walked past was above it."""
    router = Router(routing(policy="chwbl"), NAMES + ["llm-3"])
    for number, name in enumerate(loads):
        router.ledger.charge(f"x{number}", name, 1)
    decision = router.route(RouteRequest("r", "c", 10, 1, prefix_blocks(opening)), avoid=avoid).decision
    assert decision.replica not in avoid
    checks = decision.trace.details.checks
    assert checks[-1].replica == decision.replica and checks[-1].accepted
    assert all(not check.accepted and check.load > check.limit for check in checks[:-1])
    assert router.ledger.requests(decision.replica) - 1 <= decision.trace.details.cap  # type: ignore[operator]


@given(st.text(max_size=300), st.text(max_size=300))
def test_blocks_name_their_whole_prefix(head: str, tail: str) -> None:
    whole = (head.ljust(BLOCK_CHARS * 2, "-"))[: BLOCK_CHARS * 2]
    shared = prefix_blocks(whole)
    assert prefix_blocks(whole + tail)[:2] == shared and len(shared) == 2
    assert len(prefix_blocks(head)) == -(-len(head) // BLOCK_CHARS)
    changed = "#" + whole[1:] if whole[0] != "#" else "$" + whole[1:]
    assert not set(prefix_blocks(changed + tail)) & set(prefix_blocks(whole + tail))  # chained: all differ


@given(st.text(min_size=65, max_size=400) | st.text(st.characters(max_codepoint=127), min_size=65, max_size=400))
def test_blocks_are_cut_by_characters_whatever_the_text(text: str) -> None:
    """The definition, block i = characters [64i, 64i + 64) encoded (ASCII text is cut from
    its bytes, the same blocks)."""
    previous, expected = 0, []
    for start in range(0, len(text), BLOCK_CHARS):
        previous = xxhash.xxh64_intdigest(text[start : start + BLOCK_CHARS].encode(), previous)
        expected.append(previous)
    assert prefix_blocks(text) == tuple(expected) and prefix_blocks("") == ()


def test_block_hashes_are_the_same_in_every_process() -> None:
    """The service and every simulator process must agree: no salted hash() anywhere."""
    code = "from extproc.routing.blocks import prefix_blocks; print(prefix_blocks('system: be brief' * 20))"
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": seed}).stdout
        for seed in ("0", "1", "4242")
    }
    assert len(outputs) == 1 and outputs.pop().strip() == str(prefix_blocks("system: be brief" * 20))
