"""Back-to-back turns without gRPC: a turn that carries the previous answer releases that
request before it is routed itself; parallel requests on one prefix stay charged each until
their own end; Envoy's later access log entry still logs the released request, once."""

from __future__ import annotations

import time

import orjson
from hypothesis import assume, given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from extproc.routing.tokens import estimate_tokens
from extproc.service.bodies import parse_request
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.lifecycle import LOST_AFTER_S
from tests.service.test_gateway_lifecycle import TIMINGS, decisions, in_flight, make_gateway, samples

CHAT = "/v1/chat/completions"
roles = st.sampled_from(["system", "user", "assistant", "tool"])
message = st.fixed_dictionaries({"role": roles, "content": st.text(max_size=40)})
prefix = st.lists(message, min_size=1, max_size=6)


def parsed(messages: list[dict[str, str]]):  # noqa: ANN201
    return parse_request(CHAT, "application/json", orjson.dumps({"messages": messages}))


@given(before=prefix, answer=st.text(max_size=40), after=st.lists(message, max_size=4))
def test_a_body_that_resends_a_request_plus_an_answer_shows_it_answered(
    before: list[dict[str, str]], answer: str, after: list[dict[str, str]]
) -> None:
    earlier = parsed(before)
    later = parsed([*before, {"role": "assistant", "content": answer}, *after])
    assert earlier.history in later.answered


@given(shared=prefix, a=st.text(min_size=1, max_size=40), b=st.text(min_size=1, max_size=40))
def test_parallel_requests_on_one_prefix_show_none_of_each_other_answered(
    shared: list[dict[str, str]], a: str, b: str
) -> None:
    assume(a != b)
    first = parsed([*shared, {"role": "user", "content": a}])
    second = parsed([*shared, {"role": "user", "content": b}])
    assert first.history not in second.answered and second.history not in first.answered
    assert first.history != second.history


@given(messages=prefix, changed=st.text(max_size=40))
def test_an_edited_history_does_not_count_as_answered(messages: list[dict[str, str]], changed: str) -> None:
    assume(changed != messages[-1]["content"])
    edited = [*messages[:-1], {"role": messages[-1]["role"], "content": changed}]
    later = parsed([*edited, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}])
    assert parsed(messages).history not in later.answered


def chat(gateway, messages: list[dict[str, str]], conversation: str = "c-1") -> str:  # noqa: ANN001
    """Decide one chat request; the service's own id for it."""
    _, routed = gateway.route_request(
        shape=OWN_ENVOY, path=CHAT,
        content_type="application/json",
        session_headers={"x-conversation-id": conversation},
        turn="",
        request_id="from-envoy",
        body=orjson.dumps({"messages": messages, "max_tokens": 8}),
    )
    assert routed
    return next(reversed(gateway.requests.pending))


USER1 = {"role": "user", "content": "first question"}


def test_the_next_turn_releases_the_last_one_before_its_own_decision() -> None:
    gateway = make_gateway()
    gateway.metrics.watch(gateway.replica_states)
    with capture_logs() as logs:
        t1 = chat(gateway, [USER1])
        endpoint = gateway.requests.pending[t1].endpoint
        assert in_flight(gateway) == 1
        # the answer reached the client, Envoy's access log entry has not come yet
        t2 = chat(gateway, [USER1, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "more"}])
        assert in_flight(gateway) == 1  # t2 only: t1 was released first
        second = gateway.requests.pending[t2].decision
        assert second.replica == gateway.requests.pending[t1].decision.replica and second.reason in ("home", "sticky")
        # its replica holds the first prompt and the answer it wrote (its last token but one)
        held = estimate_tokens(len(USER1["content"] + "an answer"), gateway.settings.chars_per_token) - 1
        assert second.predicted_cached_tokens == held > gateway.requests.pending[t1].request.prompt_tokens
        # late: logs, releases nothing
        gateway.requests.access_logged(t1, 200, endpoint, cut_off=False, timings=TIMINGS)
        assert in_flight(gateway) == 1 and t1 not in gateway.requests.pending
        gateway.requests.access_logged(t2, 200, endpoint, cut_off=False, timings=TIMINGS)
    assert in_flight(gateway) == 0 and not gateway.requests.pending and not gateway.conversations.unanswered
    first, last = decisions(logs)
    assert first["request_id"] == t1 and first["outcome"] == "ok" and first["released_by_next_turn"] is True
    assert first["cache_n"] == 3  # what arrives later still lands in the record
    assert "released_by_next_turn" not in last
    assert samples(gateway)["llm_ring_released_by_next_turn_total", ()] == 1


def test_parallel_requests_of_one_conversation_stay_charged_until_their_own_end() -> None:
    gateway = make_gateway()
    shared = [{"role": "system", "content": "tools: search, read"}, USER1, {"role": "assistant", "content": "plan"}]
    fan_out = [[*shared, {"role": "user", "content": f"subtask {i}"}] for i in range(3)]
    p0, p1, p2 = (chat(gateway, messages) for messages in fan_out)
    assert in_flight(gateway) == 3
    tokens_during_overlap = gateway.router.ledger.total_tokens()
    # p0's answer arrives; the agent goes on from it at once, p1 and p2 still running
    answer_and_next = [{"role": "assistant", "content": "done 0"}, {"role": "user", "content": "go"}]
    following = chat(gateway, [*fan_out[0], *answer_and_next])
    assert set(gateway.router._in_flight) == {p1, p2, following}
    assert gateway.router.ledger.total_tokens() != tokens_during_overlap
    gateway.requests.access_logged(p1, 200, gateway.requests.pending[p1].endpoint, cut_off=False, timings=None)
    assert set(gateway.router._in_flight) == {p2, following}
    for request_id in (p0, p2, following):
        endpoint = gateway.requests.pending[request_id].endpoint
        gateway.requests.access_logged(request_id, 200, endpoint, cut_off=False, timings=None)
    assert in_flight(gateway) == 0 and not gateway.conversations.unanswered


def test_another_conversation_with_the_same_history_releases_nothing() -> None:
    gateway = make_gateway()
    chat(gateway, [USER1], conversation="a")
    chat(gateway, [USER1, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}], "b")
    assert in_flight(gateway) == 2


def test_a_released_request_swept_as_lost_is_logged_once() -> None:
    gateway = make_gateway()
    with capture_logs() as logs:
        t1 = chat(gateway, [USER1])
        t2 = chat(gateway, [USER1, {"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}])
        assert gateway.requests.release_lost(time.monotonic() + LOST_AFTER_S + 1) == 2
    assert in_flight(gateway) == 0 and not gateway.requests.pending and not gateway.conversations.unanswered
    assert sorted(record["request_id"] for record in decisions(logs)) == sorted([t1, t2])
