"""Each replica's speed, learnt from its answers' timings (extproc/routing/speeds.py)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.routing.policies.llm_aware.prediction import least_loaded_both, least_loaded_by_min
from extproc.routing.speeds import AnswerTimings, ReplicaSpeeds, Speed

PRIOR = Speed(1 / 167, 1 / 55, 0.019)


def answer(prompt_n: int, speed: Speed, out: int = 8, cached: int = 0) -> AnswerTimings:
    return AnswerTimings(prompt_n, (speed.overhead_s + prompt_n * speed.prefill_s_per_token) * 1000, out,
                         out * speed.decode_s_per_token * 1000, cached)


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-5, 1e-2), st.floats(1e-4, 1e-1), st.floats(0, 0.5), st.integers(0, 1000))
def test_a_replica_of_any_speed_is_learnt_from_its_answers(per_token, decode, overhead, seed):
    true = Speed(per_token, decode, overhead)
    speeds = ReplicaSpeeds(PRIOR, 0.05, True, ["llm-0"])
    rng = random.Random(seed)
    for _ in range(400):
        speeds.learn("llm-0", answer(rng.randint(1, 4000), true))
    learnt = speeds.speed("llm-0")
    assert abs(learnt.prefill_s_per_token - per_token) <= 0.02 * per_token
    assert abs(learnt.decode_s_per_token - decode) <= 0.02 * decode
    # the overhead within 2 % of the time of a mean-sized prompt
    assert abs(learnt.overhead_s - overhead) <= 0.02 * (overhead + 2000 * per_token)
    assert speeds.answers["llm-0"] == 400


def test_it_follows_a_replica_that_slows_down():
    fast = Speed(0.002, 0.02, 0.05)
    slow = Speed(0.006, 0.06, 0.15)  # three times slower
    speeds = ReplicaSpeeds(PRIOR, 0.05, True, ["llm-0", "llm-1"])
    rng = random.Random(1)
    for _ in range(200):
        speeds.learn("llm-0", answer(rng.randint(50, 2000), fast))
    before = speeds.speed("llm-0")
    answers = 0
    while speeds.speed("llm-0").prefill_s_per_token < 2.5 * before.prefill_s_per_token and answers < 200:
        speeds.learn("llm-0", answer(rng.randint(50, 2000), slow))
        answers += 1
    assert answers <= 60  # within a few dozen answers
    # the other replica learnt nothing: before its first answer it is taken to be as fast as the fleet
    assert speeds.answers["llm-1"] == 0 and speeds.speed("llm-1") == speeds.speed("llm-0") == speeds.fleet


def test_the_prior_until_an_answer_and_nonsense_is_ignored():
    speeds = ReplicaSpeeds(PRIOR, 0.05, True, ["llm-0"])
    assert speeds.speed("llm-0") == PRIOR
    speeds.learn("llm-0", AnswerTimings(-1, -1.0, -1, -1.0, -1))  # nothing known
    speeds.learn("llm-0", AnswerTimings(0, 3.0, 0, 5.0, 30))  # a full cache hit, no output
    speeds.learn("gone", answer(100, Speed(1, 1, 1)))
    assert speeds.speed("llm-0") == PRIOR and speeds.answers == {"llm-0": 0}
    # one prompt length only: the slope stays the prior's, the overhead takes up the rest
    for _ in range(100):
        speeds.learn("llm-0", AnswerTimings(100, 1000.0, 8, 80.0, 0))
    learnt = speeds.speed("llm-0")
    assert abs(learnt.overhead_s + 100 * learnt.prefill_s_per_token - 1.0) < 0.01
    assert abs(learnt.decode_s_per_token - 0.01) < 1e-3


@given(st.floats(1e-5, 1e-1))
def test_the_first_replica_trusted_is_the_fastest_whether_faster_or_slower_than_the_prior(per_token):
    speeds = ReplicaSpeeds(PRIOR, 0.05, True, ["llm-0", "llm-1"])
    assert speeds.fastest is None
    for _ in range(speeds.trust_answers):
        speeds.learn("llm-1", answer(500, Speed(per_token, 0.01, 0.0)))
    assert speeds.fastest == "llm-1"


def test_without_learning_every_replica_keeps_the_prior_and_a_new_one_starts_from_it():
    frozen = ReplicaSpeeds(PRIOR, 0.05, False, ["llm-0"])
    frozen.learn("llm-0", answer(500, Speed(1, 1, 1)))
    assert frozen.speed("llm-0") == PRIOR
    speeds = ReplicaSpeeds(PRIOR, 0.5, True, ["llm-0"])
    speeds.learn("llm-0", answer(500, Speed(0.01, 0.1, 0.2)))
    speeds.set_replicas(["llm-0", "llm-1", "llm-2"])
    learnt = speeds.speed("llm-0")
    assert learnt != PRIOR and speeds.speed("llm-1") == learnt  # a new one: the fleet's mean
    speeds.learn("llm-2", answer(500, Speed(0.03, 0.3, 0.6)))
    fleet = speeds.speed("llm-1")
    assert fleet.prefill_s_per_token == (learnt.prefill_s_per_token + speeds.speed("llm-2").prefill_s_per_token) / 2
    speeds.set_replicas(["llm-1"])  # the answered ones leave: the prior again
    assert speeds.speed("llm-1") == PRIOR
    speeds.set_replicas(["llm-0", "llm-1"])  # a returning replica is a fresh server
    assert speeds.speed("llm-0") == PRIOR and list(speeds.speeds()) == ["llm-0", "llm-1"]


def test_until_its_answers_outweigh_the_prior_a_replica_is_as_fast_as_the_fleet():
    true = Speed(1 / 30_000, 1 / 150, 0.01)  # a GPU replica, the prior a CPU one's
    speeds = ReplicaSpeeds(PRIOR, 0.05, True, ["llm-0", "llm-1", "llm-2"])
    assert speeds.trust_answers == 14  # 0.95^14 < ½
    rng = random.Random(3)
    for _ in range(13):  # not yet trusted: the fleet is still the prior, and none is the fastest
        speeds.learn("llm-0", answer(rng.randint(500, 8000), true))
    assert speeds.fleet == PRIOR and speeds.speed("llm-0") == PRIOR and speeds.fastest is None
    speeds.learn("llm-0", answer(rng.randint(500, 8000), true))
    learnt = speeds.speed("llm-0")
    assert speeds.fleet == learnt and speeds.fastest == "llm-0"
    # long prompts pull the slope towards the truth fast (the prior still weighs ½: about 10× slow yet)
    assert true.prefill_s_per_token < learnt.prefill_s_per_token < PRIOR.prefill_s_per_token / 10
    for number in range(13):  # short prompts fix no slope: left to its fit, the replica is the prior's
        speeds.learn("llm-1", answer(40 + number, true))
    assert speeds.speed("llm-1") == learnt and speeds.speed("llm-2") == learnt
    speeds.set_replicas(["llm-1", "llm-2"])  # the trusted one leaves: the prior again
    assert speeds.fleet == PRIOR and speeds.fastest is None


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=12))
def test_the_least_loaded_pair_is_min_with_its_ties(loads):
    tokens = {f"llm-{n}": load for n, (load, _) in enumerate(loads)}
    requests = {f"llm-{n}": running for n, (_, running) in enumerate(loads)}
    assert least_loaded_both(tokens, requests) == least_loaded_by_min(tokens, requests) == (
        min(tokens, key=tokens.__getitem__), min(requests, key=requests.__getitem__))
