"""Locust chat users for llm-ring: one user = one multi-turn conversation at a time.

    locust -f locustfiles/chat.py --headless -u 6 -r 3 --host http://127.0.0.1:10000 \
        --traffic-profile quick --conversation-seed 1 --policy-label bounded --records-dir out/bounded-s1

Conversations come from the deterministic generator (extproc.traffic): the same
profile and seed give the same messages whichever policy runs. Users take the next
unstarted conversation until the profile's ``conversations`` are done, then the test
stops by itself. Every turn resends the whole history with ``x-conversation-id`` and
``x-turn``. Each request becomes one row (extproc.records): appended to
``requests.jsonl`` as it happens, turned into ``requests.parquet`` at test stop, in
``--records-dir`` (`llm-ring run` gives one per run). Without ``--records-dir`` no row
is kept and nothing is written: a plain Locust run leaves the checkout as it was.
Run Locust as one process (no --processes): conversations are handed out in-process.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gevent
import requests
from locust import User, constant, events, task
from locust.exception import StopUser

from extproc.records import JOURNAL_FILE, finalise_run_records, journal_row
from extproc.traffic import Conversation, Profile, generate_conversations, load_profile
from extproc.traffic.chat import (
    CHAT_PATH,
    Answer,
    header_int,
    prompt_estimate,
    read_json_answer,
    read_sse_line,
    request_body,
    request_headers,
    session_message,
    session_tag,
    timing_fields,
)


@events.init_command_line_parser.add_listener
def _options(parser: Any) -> None:
    group = parser.add_argument_group("llm-ring")
    group.add_argument("--traffic-profile", default="quick", help="traffic profile name or JSON path")
    group.add_argument("--conversation-seed", type=int, default=1, help="seed of the conversations")
    group.add_argument("--policy-label", default="unknown", help="policy name written in the records")
    group.add_argument("--run-id", default="", help="run id in the records (default <policy>-s<seed>)")
    group.add_argument("--records-dir", default="", help="run folder for the request rows (default: none kept)")
    group.add_argument("--model", default="llm-ring", help="model field sent in requests")
    group.add_argument("--session", default="", help="session tag starting every conversation")
    group.add_argument("--new-connections", action="store_true",
                       help="every request on a connection of its own (as a CLI run once a turn does)")


class Plan:
    """The run's conversations, who has which, and the journal the rows go to."""

    def __init__(self, environment: Any) -> None:
        options = environment.parsed_options
        self.environment = environment
        self.profile: Profile = load_profile(options.traffic_profile)
        self.seed: int = options.conversation_seed
        self.policy: str = options.policy_label
        self.run_id: str = options.run_id or f"{self.policy}-s{self.seed}"
        self.model: str = options.model
        self.session: str = options.session or session_tag(self.run_id, time.time())
        self.new_connections: bool = options.new_connections
        self.run_dir = Path(options.records_dir) if options.records_dir else None
        self.conversations: list[Conversation] = generate_conversations(self.profile, self.seed)
        self.next_index = 0
        self.finished = 0
        self.journal = None
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self.journal = (self.run_dir / JOURNAL_FILE).open("a", buffering=1)  # line-buffered

    def take(self) -> Conversation | None:
        if self.next_index >= len(self.conversations):
            return None
        self.next_index += 1
        return self.conversations[self.next_index - 1]

    def done(self) -> None:
        self.finished += 1
        if self.finished == len(self.conversations):
            # Every conversation is over: stop the test (from outside the user's own greenlet).
            gevent.spawn(self.environment.runner.quit)

    def record(self, row: dict[str, Any]) -> None:
        if self.journal is not None:
            self.journal.write(journal_row(row) + "\n")

    def close(self) -> str:
        """What became of the rows, for the log."""
        if self.journal is None or self.run_dir is None:
            return "request rows not kept (no --records-dir)"
        self.journal.close()
        return f"{finalise_run_records(self.run_dir)} request rows -> {self.run_dir}"


PLAN: Plan | None = None


@events.test_start.add_listener
def _start(environment: Any, **_: Any) -> None:
    global PLAN
    PLAN = Plan(environment)


@events.request.add_listener
def _record(context: dict | None = None, **_: Any) -> None:
    if PLAN is not None and context and "record" in context:
        PLAN.record(context["record"])


@events.test_stop.add_listener
def _stop(environment: Any, **_: Any) -> None:
    global PLAN
    if PLAN is not None:
        print(f"llm-ring: {PLAN.close()}", flush=True)
        PLAN = None


class ChatUser(User):
    wait_time = constant(0)  # pacing comes from each turn's think time

    def on_start(self) -> None:
        self.http = requests.Session()

    def on_stop(self) -> None:
        self.http.close()

    @task
    def converse(self) -> None:
        plan = PLAN
        conversation = plan.take() if plan else None
        if plan is None or conversation is None:
            raise StopUser()
        history = [session_message(plan.session, conversation.system)]
        for number, turn in enumerate(conversation.turns, start=1):
            time.sleep(turn.think_time_s)
            # A fan-out: the sides go out at the same moment on the same history, each recorded
            # as conversation <id>/p<k>; the conversation goes on once every answer is in.
            sides = [
                gevent.spawn(self._send, plan, conversation, number, [*history, {"role": "user", "content": side.text}],
                             turn.max_tokens, f"{conversation.id}/p{k}")  # fmt: skip
                for k, side in enumerate(turn.parallel, start=1)
            ]
            messages = [*history, {"role": "user", "content": turn.text}]
            answer, row = self._send(plan, conversation, number, messages, turn.max_tokens)
            gevent.joinall(sides)
            if row["error"] is None:  # a failed turn is left out of the history, like a retry
                history = [*messages, {"role": "assistant", "content": answer.content}]
        plan.done()

    def _send(
        self,
        plan: Plan,
        conversation: Conversation,
        number: int,
        messages: list[dict[str, str]],
        max_tokens: int,
        recorded_as: str = "",
    ) -> tuple[Answer, dict[str, Any]]:
        profile = plan.profile
        body = request_body(messages, max_tokens, profile.stream, plan.model)
        answer, status, error, ttft = Answer(), 0, None, None
        headers: Mapping[str, str] = {}
        started = time.time()
        # a connection of its own: behind a front that spreads connections (several gateways),
        # consecutive turns then meet different gateways
        http = requests.Session() if plan.new_connections else self.http
        try:
            with http.post(
                str(self.host).rstrip("/") + CHAT_PATH,
                json=body,
                headers=request_headers(conversation.id, number),
                stream=profile.stream,
                timeout=(10, profile.max_duration_s),
            ) as response:
                status, headers = response.status_code, response.headers
                if status != 200:
                    error = f"HTTP {status}: {response.text[:200]}"
                elif profile.stream:
                    for line in response.iter_lines():
                        if read_sse_line(line, answer):
                            ttft = time.time() - started
                else:
                    answer = read_json_answer(response.content)
        except (requests.RequestException, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            if http is not self.http:
                http.close()
        finished = time.time()
        if error is None and not answer.timings:
            error = "no timings in the answer"
        row = {
            "run_id": plan.run_id,
            "policy": plan.policy,
            "seed": plan.seed,
            "simulated": False,
            "conversation": recorded_as or conversation.id,
            "turn": number,
            "replica": headers.get("x-routed-to"),
            "route_reason": headers.get("x-route-reason"),
            "est_prompt_tokens": prompt_estimate(messages, profile.chars_per_token),
            "predicted_cached_tokens": header_int(headers, "x-route-predicted-cached-tokens"),
            "queue_wait_s": None if (waited := header_int(headers, "x-route-queue-wait-ms")) is None else waited / 1000,
            **timing_fields(answer.timings),
            "ttft_s": ttft,
            "latency_s": finished - started,
            "status": status,
            "error": error,
            "started_at": started,
            "finished_at": finished,
        }
        self.environment.events.request.fire(
            request_type="POST",
            name="parallel" if recorded_as else "first turn" if number == 1 else "follow-up",
            response_time=(finished - started) * 1000,
            response_length=len(answer.content),
            exception=RuntimeError(error) if error else None,
            context={"record": row},
        )
        return answer, row
