"""A request's life in the gateway, without gRPC: decided, then ended by Envoy's access log
entry (and, for a streamed answer, the observer's last chunk), or released as lost when the
entry never comes; an Endpoint Picker's stream driven message by message in-process. The load
is released exactly once in every case."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from grpc.aio import EOF
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from extproc.routing import Router
from extproc.routing.placement import Placement
from extproc.routing.settings import with_knobs
from extproc.service.bodies import Timings
from extproc.service.dataplanes.own_envoy import OWN_ENVOY
from extproc.service.dataplanes.picker import FULL_DUPLEX, PickerStream
from extproc.service.dataplanes.plane import Serving
from extproc.service.gateway import Gateway
from extproc.service.lifecycle import LOST_AFTER_S, Pending
from extproc.service.metrics import Metrics
from extproc.settings import load_settings, parse_routing

SETTINGS = load_settings(Path(__file__).parents[2] / "extproc" / "service" / "router.toml")
ENDPOINTS = {"llm-0": "127.0.0.1:9000", "llm-1": "127.0.0.1:9001", "llm-2": "127.0.0.1:9002"}
TIMINGS = Timings(cache_n=3, prompt_n=5, prompt_ms=1.0, predicted_n=2, predicted_ms=1.0)


def make_gateway(grace_ms: int = 200, prefix_index: bool = True) -> Gateway:
    """prefix_index False: conversations placed by their keys alone (the index would place them where
    their prefix is cached, as these tests' fixed timings, cache_n 3 on every turn, mislead it)."""
    service = SETTINGS.service.model_copy(update={"observe_grace_ms": grace_ms})
    routing = SETTINGS.routing if prefix_index else parse_routing(with_knobs(SETTINGS.routing.table(),
                                                                             {"prefix_index": False}))
    gateway = Gateway(Router(routing), service, Metrics())
    gateway.set_replicas(ENDPOINTS)
    return gateway


def decide(gateway: Gateway, request_id: str, stream: bool = False) -> tuple[str, str]:
    """(the service's own id for the request, the pick's endpoint)."""
    body = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": stream})
    gateway.route_request(
        shape=OWN_ENVOY, path="/v1/chat/completions",
        content_type="application/json",
        session_headers={"x-conversation-id": "c-1"},
        turn="1",
        request_id=request_id,
        body=body,
    )
    ours = next(reversed(gateway.requests.pending))
    return ours, gateway.requests.pending[ours].endpoint


def logged(gateway: Gateway, answer: bytes, routed: str | None) -> Pending | bytes:
    """A route_request's outcome: the gateway's own answer, or its routed request once its
    access log entry (200, TIMINGS) has come."""
    if routed is None:
        return answer
    pending = gateway.requests.pending[routed]
    gateway.requests.access_logged(routed, 200, pending.endpoint, cut_off=False, timings=TIMINGS)
    return pending


def in_flight(gateway: Gateway) -> int:
    return gateway.router.ledger.total_requests()


def decisions(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "route_decision"]


def test_a_json_answer_ends_with_its_access_log_entry() -> None:
    gateway = make_gateway()
    with capture_logs() as logs:
        r1, endpoint = decide(gateway, "envoy-r1")
        assert in_flight(gateway) == 1
        gateway.requests.access_logged(r1, 200, endpoint, cut_off=False, timings=TIMINGS)
        gateway.requests.access_logged(r1, 200, endpoint, cut_off=False, timings=TIMINGS)  # a duplicate: no-op
    assert in_flight(gateway) == 0 and not gateway.requests.pending
    (record,) = decisions(logs)
    assert record["outcome"] == "ok" and record["cache_n"] == 3 and "access_log_lost" not in record


def test_a_client_that_hangs_up_is_abandoned() -> None:
    gateway = make_gateway()
    with capture_logs() as logs:
        r1, endpoint = decide(gateway, "envoy-r1")
        gateway.requests.access_logged(r1, 200, endpoint, cut_off=True, timings=None)
    assert in_flight(gateway) == 0
    assert decisions(logs)[0]["outcome"] == "abandoned"


def test_a_lost_access_log_entry_is_made_up_for_once_the_request_must_be_over() -> None:
    gateway = make_gateway()
    with capture_logs() as logs:
        r1, endpoint = decide(gateway, "envoy-r1")
        now = time.monotonic()
        assert gateway.requests.release_lost(now + LOST_AFTER_S - 1) == 0  # may still be generating
        assert in_flight(gateway) == 1
        assert gateway.requests.release_lost(now + LOST_AFTER_S + 1) == 1
        assert in_flight(gateway) == 0
        assert gateway.requests.release_lost(now + 2 * LOST_AFTER_S) == 0
        gateway.requests.access_logged(r1, 200, endpoint, cut_off=False, timings=TIMINGS)  # too late: no-op
    assert in_flight(gateway) == 0
    (record,) = decisions(logs)
    assert record["outcome"] == "abandoned" and record["access_log_lost"] is True


def test_a_streamed_answer_waits_for_the_observers_last_chunk() -> None:
    async def scenario() -> list[dict[str, Any]]:
        gateway = make_gateway()
        with capture_logs() as logs:
            r1, endpoint = decide(gateway, "envoy-r1", stream=True)
            assert gateway.requests.observe_start(r1, 200, endpoint) == r1
            gateway.requests.observe_body(r1, b'data: {"content": "hi"}\n\n', end_of_stream=False)
            gateway.requests.access_logged(r1, 200, endpoint, cut_off=False, timings=None)  # the log came first
            assert in_flight(gateway) == 1
            last = b'data: {"content": "", "timings": {"cache_n": 7, "prompt_n": 1}}\n\n'
            gateway.requests.observe_body(r1, last, end_of_stream=True)
            assert in_flight(gateway) == 0
            await asyncio.sleep(0.05)  # the grace timer was cancelled: nothing more happens
        return logs

    (record,) = decisions(asyncio.run(scenario()))
    assert record["outcome"] == "ok" and record["cache_n"] == 7


@pytest.mark.parametrize("cut_off, outcome", [(False, "ok"), (True, "abandoned")])
def test_a_streamed_answer_whose_end_is_not_observed_is_released_after_the_grace(cut_off: bool, outcome: str) -> None:
    async def scenario() -> list[dict[str, Any]]:
        gateway = make_gateway(grace_ms=20)
        with capture_logs() as logs:
            r1, endpoint = decide(gateway, "envoy-r1", stream=True)
            gateway.requests.access_logged(r1, 200, endpoint, cut_off=cut_off, timings=None)
            assert in_flight(gateway) == 1  # the observer may still deliver the end and the timings
            await asyncio.sleep(0.1)
            assert in_flight(gateway) == 0
        return logs

    (record,) = decisions(asyncio.run(scenario()))
    assert record["outcome"] == outcome and "cache_n" not in record


@pytest.mark.parametrize("log_first", [True, False])
@pytest.mark.parametrize("end_seen", [True, False])
def test_a_stream_the_replica_ended_is_whole_though_the_client_hung_up_after_done(log_first: bool,
                                                                                  end_seen: bool) -> None:
    """The openai SDK closes the connection right after [DONE]: Envoy logs a downstream
    termination, which is no abandonment when the replica had sent its end."""
    async def scenario() -> list[dict[str, Any]]:
        gateway = make_gateway(grace_ms=20)
        with capture_logs() as logs:
            r1, endpoint = decide(gateway, "envoy-r1", stream=True)
            gateway.requests.observe_start(r1, 200, endpoint)
            if log_first:
                gateway.requests.access_logged(r1, 200, endpoint, cut_off=True, timings=None)
            last = b'data: {"choices": [], "timings": {"cache_n": 7, "prompt_n": 1}}\n\ndata: [DONE]\n\n'
            gateway.requests.observe_body(r1, last, end_of_stream=end_seen)
            if not log_first:
                gateway.requests.access_logged(r1, 200, endpoint, cut_off=True, timings=None)
            await asyncio.sleep(0.1)
            assert in_flight(gateway) == 0
        return logs

    (record,) = decisions(asyncio.run(scenario()))
    assert record["outcome"] == "ok" and record["cache_n"] == 7


def complete_turn(gateway: Gateway, messages: list[dict[str, str]], conversation: str = "", served: str = "",
                  **extra: Any) -> Pending:
    """One chat request (no conversation id: keyed on its opening), decided and answered whole by
    its pick (or by ``served``, a replica's name: a fallback); ``extra``: more body fields."""
    body = orjson.dumps({"messages": messages, "max_tokens": 8, **extra})
    named = {"x-conversation-id": conversation} if conversation else {}
    gateway.route_request(shape=OWN_ENVOY,
                          path="/v1/chat/completions", content_type="application/json", session_headers=named,
                          turn="", request_id="", body=body)
    ours = next(reversed(gateway.requests.pending))
    pending = gateway.requests.pending[ours]
    gateway.requests.access_logged(ours, 200, ENDPOINTS[served] if served else pending.endpoint, cut_off=False,
                          timings=TIMINGS)
    gateway.mark_healthy(pending.decision.replica)  # a pick that refused: its probe answers again at once
    return pending


def send_turn(gateway: Gateway, messages: list[dict[str, str]]) -> str:
    """One chat request decided, not yet answered: the service's own id for it."""
    body = orjson.dumps({"messages": messages, "max_tokens": 8})
    gateway.route_request(shape=OWN_ENVOY,
                          path="/v1/chat/completions", content_type="application/json", session_headers={},
                          turn="", request_id="", body=body)
    return next(reversed(gateway.requests.pending))


def four_turns(gateway: Gateway, name: str) -> tuple[list[dict[str, str]], list[Pending]]:
    """A 4-turn chat: its messages and each turn's request."""
    messages = [{"role": "system", "content": f"You help {name}."}]
    turns = []
    for turn in range(4):
        messages.append({"role": "user", "content": f"{name}: question {turn} " + "lorem ipsum " * 40})
        turns.append(complete_turn(gateway, messages))
        messages.append({"role": "assistant", "content": f"answer {turn} to {name}"})
    return messages, turns


def placement(gateway: Gateway, request: Pending) -> Placement | None:
    return gateway.router.memory.get(gateway.router.conversation_key(request.request.conversation))


def test_an_edited_turn_starts_where_its_prefix_was_served_and_moves_nothing() -> None:
    """Editing turn 2 of a chat (every chat UI allows it) resends turn 1 and its answer, then
    another question: no continuation, a key of its own, and still the replica holding turn 1."""
    gateway = make_gateway()
    for chat in range(12):
        messages, turns = four_turns(gateway, f"user {chat}")
        placed = placement(gateway, turns[-1])
        edited = [*messages[:3], {"role": "user", "content": f"user {chat}: an edited second question"}]
        branch = complete_turn(gateway, edited)
        assert branch.request.conversation != turns[-1].request.conversation  # a key of its own
        assert branch.decision.replica == turns[0].decision.replica, chat
        assert branch.predicted_cached_tokens >= turns[0].request.prompt_tokens - 1
        assert placement(gateway, turns[-1]) == placed  # the chat it branched from is where it was
        messages.append({"role": "user", "content": "and the next turn of the original"})
        assert complete_turn(gateway, messages).decision.replica == turns[-1].decision.replica  # still continues
    assert gateway.metrics.branches == 12


@pytest.mark.parametrize("turn_ends", [0, 1, 2])
def test_an_agents_next_turn_after_a_fan_out_continues_its_conversation_whichever_request_ended_last(
    turn_ends: int,
) -> None:
    """An agent's fan-out: its turn and two more requests sent at once on the same history, the
    loop going on from the turn's answer. Whether the turn's answer ends first, between or last,
    the next turn continues the conversation: its key, its replica (each branch is a tip)."""
    gateway = make_gateway()
    for chat in range(6):
        messages, turns = four_turns(gateway, f"agent {chat}")
        turn = [*messages, {"role": "user", "content": "the loop's own next step"}]
        sides = [send_turn(gateway, [*messages, {"role": "user", "content": f"side {k} " + "lorem " * 30}])
                 for k in range(2)]
        ending = [*sides[:turn_ends], send_turn(gateway, turn), *sides[turn_ends:]]
        for ours in ending:
            endpoint = gateway.requests.pending[ours].endpoint
            gateway.requests.access_logged(ours, 200, endpoint, cut_off=False, timings=TIMINGS)
        after = complete_turn(gateway, [*turn, {"role": "assistant", "content": "done"},
                                        {"role": "user", "content": "go on"}])
        assert after.request.conversation == turns[-1].request.conversation, (chat, turn_ends)
        assert after.decision.replica == turns[-1].decision.replica
    assert gateway.metrics.branches == 0


def test_an_agents_next_turn_continues_its_conversation_before_the_fan_outs_turn_is_logged() -> None:
    """The fan-out's other requests are over, its turn's access log entry has not come yet (Envoy
    sends them in batches) when the next turn, which shows its answer, arrives: it continues the
    conversation on its replica and releases that turn; the late entry releases nothing twice."""
    gateway = make_gateway()
    messages, turns = four_turns(gateway, "agent")
    turn = [*messages, {"role": "user", "content": "the loop's own next step"}]
    sides = [send_turn(gateway, [*messages, {"role": "user", "content": f"side {k} " + "lorem " * 30}])
             for k in range(2)]
    own = send_turn(gateway, turn)
    for ours in sides:
        endpoint = gateway.requests.pending[ours].endpoint
        gateway.requests.access_logged(ours, 200, endpoint, cut_off=False, timings=TIMINGS)
    endpoint = gateway.requests.pending[own].endpoint
    after = complete_turn(gateway, [*turn, {"role": "assistant", "content": "done"}, {"role": "user", "content": "on"}])
    assert after.request.conversation == turns[-1].request.conversation
    assert after.decision.replica == turns[-1].decision.replica
    gateway.requests.access_logged(own, 200, endpoint, cut_off=False, timings=TIMINGS)
    assert in_flight(gateway) == 0 and gateway.metrics.branches == 0


def test_a_stranger_with_the_same_opening_moves_nothing_and_is_placed_only_by_the_prefix_it_proves() -> None:
    gateway = make_gateway()
    messages, turns = four_turns(gateway, "victim")
    placed = placement(gateway, turns[-1])
    forged = [*messages[:2], {"role": "assistant", "content": "a guessed answer"}, {"role": "user", "content": "?"}]
    branch = complete_turn(gateway, forged)  # the opening alone is proven: the first turn's prompt
    assert branch.decision.replica == turns[0].decision.replica
    # no more than the first turn's prompt and its answer (what that replica holds of the opening)
    assert branch.predicted_cached_tokens <= turns[0].request.prompt_tokens + (TIMINGS.predicted_n or 0) + 1
    for _ in range(2):
        complete_turn(gateway, forged)
    assert placement(gateway, turns[-1]) == placed
    messages.append({"role": "user", "content": "the victim's next turn"})
    assert complete_turn(gateway, messages).decision.replica == turns[-1].decision.replica


def test_a_regenerated_answer_and_a_retried_first_message_start_where_their_prefix_was_served() -> None:
    """After 4 turns, turn 2 resent as it was (regenerate its answer) and the first message resent
    with tools (a tool_choice retry): neither continues the chat's last turn; each goes where the
    request it resends was served, under a key of its own."""
    gateway = make_gateway()
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    for chat in range(12):
        messages, turns = four_turns(gateway, f"user {chat}")
        placed = placement(gateway, turns[-1])
        regenerated = complete_turn(gateway, messages[:4])
        assert regenerated.decision.replica == turns[1].decision.replica, chat
        assert regenerated.predicted_cached_tokens >= turns[1].request.prompt_tokens - 1
        retried = complete_turn(gateway, messages[:2], tools=[tool], tool_choice="required")
        assert retried.decision.replica == turns[0].decision.replica, chat
        assert {regenerated.request.conversation, retried.request.conversation}.isdisjoint(
            {turns[-1].request.conversation})
        assert placement(gateway, turns[-1]) == placed
    assert gateway.metrics.branches == 24


def test_new_conversations_sharing_a_first_message_are_not_piled_on_its_replica() -> None:
    """A first message many users send (the same system prompt and question) under new ids: each is
    a new conversation, spread by its id, not sent as a branch where the first of them was served
    (the prefix index, when on, may send them there for the opening it caches: its choice, by cost)."""
    gateway = make_gateway(prefix_index=False)
    opening = [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hello, how are you?"}]
    first = complete_turn(gateway, opening, "user-0")
    later = [complete_turn(gateway, opening, f"user-{index}") for index in range(1, 31)]
    assert gateway.metrics.branches == 0
    assert {turn.decision.replica for turn in later} == set(ENDPOINTS)
    assert any(turn.decision.replica != first.decision.replica for turn in later)


def test_a_stranger_proving_the_opening_is_not_told_where_the_conversation_went_since() -> None:
    """The chat's first turn was served on one replica, its later turns by another (a fallback):
    a stranger's body with the same opening, under the chat's id, no id or another's, is placed
    where the opening was served with the opening's tokens, not where the chat is now; the
    chat's placement stays, and its next turn still goes there."""
    gateway = make_gateway(prefix_index=False)
    system = {"role": "system", "content": "You help the victim."}
    messages = [system, {"role": "user", "content": "victim: question 0 " + "lorem ipsum " * 40}]
    first = complete_turn(gateway, messages, "victim")
    elsewhere = next(name for name in sorted(ENDPOINTS) if name != first.decision.replica)
    for turn in range(1, 4):
        messages += [{"role": "assistant", "content": f"answer {turn}"},
                     {"role": "user", "content": f"victim: question {turn} " + "dolor sit " * 40}]
        last = complete_turn(gateway, messages, "victim", served=elsewhere)
    placed = placement(gateway, last)
    assert placed is not None and placed.replica == elsewhere
    for name in ("victim", "", "someone else"):
        forged = [*messages[:2], {"role": "assistant", "content": "a guessed answer"},
                  {"role": "user", "content": f"{name}?"}]
        stranger = complete_turn(gateway, forged, name)
        assert stranger.decision.replica == first.decision.replica, name
        assert stranger.predicted_cached_tokens <= first.request.prompt_tokens + (TIMINGS.predicted_n or 0) + 1
        assert not stranger.continued and stranger.request.conversation != last.request.conversation
    assert placement(gateway, last) == placed
    messages.append({"role": "user", "content": "the victim's next turn"})
    assert complete_turn(gateway, messages, "victim").decision.replica == elsewhere


def test_a_stranger_after_an_edit_moves_neither_the_chat_nor_its_edited_branch() -> None:
    """The owner edits turn 2 under the chat's id, then goes on in the edited chat; strangers with
    the same id and opening in between get keys of their own: the edited branch keeps its
    placement (replica and tokens) and its next turn continues it."""
    gateway = make_gateway()
    for chat in range(6):
        name = f"owner {chat}"
        messages = [{"role": "system", "content": f"You help {name}."}]
        for turn in range(4):
            messages.append({"role": "user", "content": f"{name}: question {turn} " + "lorem ipsum " * 40})
            last = complete_turn(gateway, messages, name)
            messages.append({"role": "assistant", "content": f"answer {turn}"})
        placed = placement(gateway, last)
        edited = [*messages[:3], {"role": "user", "content": f"{name}: an edited second question"}]
        edit = complete_turn(gateway, edited, name)
        branch_placed = placement(gateway, edit)
        for stranger in range(3):
            forged = [*messages[:2], {"role": "assistant", "content": "a guessed answer"},
                      {"role": "user", "content": f"stranger {stranger}: " + "more words " * (20 * stranger)}]
            taken = complete_turn(gateway, forged, name)
            assert taken.request.conversation not in (edit.request.conversation, last.request.conversation)
        assert (placement(gateway, edit), placement(gateway, last)) == (branch_placed, placed)
        edited += [{"role": "assistant", "content": "the edited answer"}, {"role": "user", "content": "and then?"}]
        follow_up = complete_turn(gateway, edited, name)
        assert follow_up.continued and follow_up.request.conversation == edit.request.conversation
        assert follow_up.decision.replica == edit.decision.replica


def test_metrics_count_what_happened() -> None:
    gateway = make_gateway()
    gateway.metrics.watch(gateway.replica_states)
    with capture_logs() as logs:
        r1, endpoint = decide(gateway, "envoy-r1")
        scraped = samples(gateway)
        assert scraped["llm_ring_in_flight_requests", (("replica", record_replica(gateway, r1)),)] == 1
        gateway.requests.access_logged(r1, 200, endpoint, cut_off=False, timings=TIMINGS)
        r2, _ = decide(gateway, "envoy-r2")
        gateway.requests.access_logged(r2, 200, endpoint, cut_off=True, timings=None)
        gateway.route_request(shape=OWN_ENVOY,
                       path="/v1/chat/completions", content_type="application/json", session_headers={}, turn="",
                       request_id="r3", body=b"{not json")  # fmt: skip
    first = decisions(logs)[0]
    scraped = samples(gateway)
    reason = (("policy", "llm-aware"), ("reason", first["reason"]))
    assert scraped["llm_ring_decisions_total", reason] == 2
    assert scraped["llm_ring_requests_completed_total", (("outcome", "ok"),)] == 1
    assert scraped["llm_ring_requests_completed_total", (("outcome", "abandoned"),)] == 1
    assert scraped["llm_ring_errors_total", (("kind", "bad_request"),)] == 1
    served = (("replica", first["served_replica"]),)
    assert scraped["llm_ring_actual_cached_tokens_total", served] == 3
    assert scraped["llm_ring_actual_prompt_tokens_total", served] == 8
    assert scraped["llm_ring_predicted_cached_tokens_total", served] == first["predicted_cached_tokens"]
    error = 3 - first["predicted_cached_tokens"]  # one request, in every bucket from its own up
    for (name, labels), value in scraped.items():
        if name == "llm_ring_cached_tokens_prediction_error_bucket":
            assert value == (error <= float(dict(labels)["le"]))
    assert scraped["llm_ring_decision_seconds_count", ()] == 2
    assert scraped["llm_ring_decision_seconds_bucket", (("le", "+Inf"),)] == 2
    assert all(value == 0 for (name, _), value in scraped.items() if name == "llm_ring_in_flight_requests")


def record_replica(gateway: Gateway, request_id: str) -> str:
    return gateway.requests.pending[request_id].decision.replica


def samples(gateway: Gateway) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(gateway.metrics.registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


class HangsUpAfterTheAnswer:
    """An Endpoint Picker's gRPC context whose stream Envoy resets while the picker answers the
    last response chunk: Envoy had passed it on, and the client, having read the whole answer,
    hung up at once."""

    def __init__(self, messages: list[Any]) -> None:
        self.messages = messages
        self.last_read_ended = False

    async def read(self) -> Any:
        if not self.messages:
            return EOF
        message = self.messages.pop(0)
        self.last_read_ended = message.WhichOneof("request") == "response_body" and message.response_body.end_of_stream
        return message

    async def write(self, answer: bytes) -> None:
        if self.last_read_ended:
            raise asyncio.CancelledError


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_picker_stream_reset_as_the_answers_end_goes_out_is_whole(stream: bool) -> None:
    """The picker observes a response chunk before it answers it: the stream's reset, the
    instant the client had the end, finds the answer whole (seen with LiteLLM, which closes its
    connection as soon as it has read a JSON answer: logged ``abandoned``, its timings lost)."""
    def headers(pairs: dict[str, str], end: bool = False) -> pb.HttpHeaders:
        values = [base_pb2.HeaderValue(key=key, raw_value=value.encode()) for key, value in pairs.items()]
        return pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end)

    timings = b'"timings": {"cache_n": 3, "prompt_n": 5, "prompt_ms": 1.0, "predicted_n": 2, "predicted_ms": 1.0}'
    answer = (b'data: {"choices": [{"delta": {"content": "hi"}}], ' + timings + b"}\n\ndata: [DONE]\n\n" if stream
              else b'{"choices": [{"message": {"content": "hi"}}], ' + timings + b"}")
    body = orjson.dumps({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "stream": stream})
    messages = [
        pb.ProcessingRequest(
            request_headers=headers({":method": "POST", ":path": "/v1/chat/completions",
                                     "content-type": "application/json"}),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX, response_body_mode=FULL_DUPLEX)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=headers({":status": "200"})),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=answer[:10], end_of_stream=False)),
        pb.ProcessingRequest(response_body=pb.HttpBody(body=answer[10:], end_of_stream=True)),
    ]
    gateway = make_gateway()
    picker = PickerStream(Serving(gateway), HangsUpAfterTheAnswer(messages[1:]))  # type: ignore[arg-type]
    with capture_logs() as logs, pytest.raises(asyncio.CancelledError):
        asyncio.run(picker.serve(messages[0]))
    assert in_flight(gateway) == 0 and not gateway.requests.pending
    (record,) = decisions(logs)
    assert (record["outcome"], record["cache_n"], record["prompt_n"]) == ("ok", 3, 5), record
