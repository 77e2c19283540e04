from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing import HashRing, stable_hash

names = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=12, unique=True)


@given(names, st.integers(min_value=0, max_value=2**64 - 1))
def test_walk_visits_every_replica_once_starting_at_home(replicas: list[str], key_hash: int) -> None:
    ring = HashRing(replicas, vnodes=8, seed=0)
    walk = list(ring.walk(key_hash))
    assert sorted(walk) == sorted(replicas)
    assert walk[0] == ring.home(key_hash)


def test_empty_ring_has_no_home() -> None:
    ring = HashRing([], vnodes=10, seed=0)
    assert ring.home(123) is None
    assert list(ring.walk(123)) == []


def _moved_share(before: list[str], after: list[str], pick) -> float:
    keys = [f"conversation-{i}" for i in range(20_000)]
    moved = sum(pick(before, key) != pick(after, key) for key in keys)
    return moved / len(keys)


def test_adding_a_fourth_replica_moves_a_quarter_under_consistent_three_quarters_under_mod_n() -> None:
    three, four = ["llm-0", "llm-1", "llm-2"], ["llm-0", "llm-1", "llm-2", "llm-3"]
    rings = {len(three): HashRing(three, 100, 0), len(four): HashRing(four, 100, 0)}

    def consistent(replicas: list[str], key: str) -> str | None:
        return rings[len(replicas)].home(stable_hash(key))

    def mod_n(replicas: list[str], key: str) -> str:
        return sorted(replicas)[stable_hash(key) % len(replicas)]

    assert 0.18 <= _moved_share(three, four, consistent) <= 0.32
    assert 0.70 <= _moved_share(three, four, mod_n) <= 0.80


@settings(max_examples=25)
@given(names, st.text(max_size=20))
def test_removing_a_replica_moves_only_its_own_keys(replicas: list[str], key: str) -> None:
    ring = HashRing(replicas, vnodes=20, seed=7)
    home = ring.home(stable_hash(key, 7))
    for gone in replicas:
        smaller = HashRing([r for r in replicas if r != gone], vnodes=20, seed=7)
        if home != gone:
            assert smaller.home(stable_hash(key, 7)) == home


def test_lookups_are_identical_across_processes_with_different_hash_seeds() -> None:
    program = (
        "from extproc.routing import HashRing, stable_hash\n"
        "ring = HashRing(['llm-0', 'llm-1', 'llm-2', 'llm-3'], 50, 3)\n"
        "print([ring.home(stable_hash(f'c{i}', 3)) for i in range(200)])\n"
    )
    outputs = set()
    for hash_seed in ("1", "2", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True,
                                text=True, check=True)
        outputs.add(result.stdout)
    assert len(outputs) == 1
