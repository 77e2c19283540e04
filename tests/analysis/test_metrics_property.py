"""The SQL agrees with a direct Python reading of the definitions, on random runs."""

import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from analysis.fixtures import request, write_run
from extproc.analysis.metrics import connect, per_run

turn_strategy = st.tuples(
    st.sampled_from(["llm-0", "llm-1", "llm-2"]),
    st.integers(0, 300),  # cache_n
    st.integers(1, 300),  # prompt_n
    st.sampled_from([200, 200, 200, 503]),
)
conversations_strategy = st.lists(st.lists(turn_strategy, min_size=1, max_size=6), min_size=1, max_size=6)


def reference(conversations, hit_share=0.5):
    followups = hits = avoidable = redirects = 0
    work: dict[str, int] = {}
    for turns in conversations:
        for number, (replica, cache_n, prompt_n, status) in enumerate(turns):
            if status == 200:
                work[replica] = work.get(replica, 0) + prompt_n
            if number == 0 or status != 200 or turns[number - 1][3] != 200:
                continue
            previous = turns[number - 1]
            followups += 1
            hit = cache_n >= hit_share * (previous[1] + previous[2])
            hits += hit
            redirects += replica != previous[0]
            avoidable += (not hit) and replica != previous[0]
    imbalance = max(work.values()) / (sum(work.values()) / len(work)) if work else None
    return followups, hits, avoidable, redirects, imbalance


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations=conversations_strategy)
def test_sql_matches_the_definitions(conversations):
    rows = [
        request("r", "p", 1, f"c{c}", n + 1, replica, cache_n, prompt_n, at=c + n, status=status,
                error=None if status == 200 else "HTTP 503")
        for c, turns in enumerate(conversations)
        for n, (replica, cache_n, prompt_n, status) in enumerate(turns)
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as root:
        write_run(Path(root), "r", "p", 1, rows)
        (run,) = per_run(connect(root))
    followups, hits, avoidable, redirects, imbalance = reference(conversations)
    assert (run["followups"], run["hits"]) == (followups, hits)
    assert (run["avoidable_misses"], run["redirects"]) == (avoidable, redirects)
    assert run["imbalance"] == (None if imbalance is None else pytest.approx(imbalance))
