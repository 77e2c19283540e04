"""`llm-ring bench flow`: the noisy-neighbour scenario of flow control, against a running gateway.

Two tenants, named as the Gateway API Inference Extension names them (the fairness header):
  - quiet: 3 chats of 4 short streamed turns, each turn 0.5 s after the last answer;
  - noisy: 8 conversations at once, each pasting a ~600-word document, 3 turns, no pause.
Phase "alone": the quiet tenant alone. Phase "flood": the noisy tenant starts, the quiet one
``--quiet-after`` seconds later. Per phase: the quiet tenant's TTFT (p50, p95), its follow-ups
that landed on the replica of their previous turn, the noisy tenant's answers, and the fleet's
answered tokens per second (every answer's generated tokens over the phase's span). Each
round runs both phases; a session line opens every conversation, so no round finds another's
cache. ``--step-bound REPLICA_URL`` measures instead what one pasted document in a replica's
batch costs a short request's first token (llama.cpp does not preempt: a request that arrives
while a prompt step runs waits for that step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from extproc.traffic.chat import Answer, read_sse_line, request_body, session_message
from extproc.traffic.words import paragraphs, sentence

TENANT_HEADER = "x-gateway-inference-fairness-id"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
CHAT = "/v1/chat/completions"
QUIET_CHATS, QUIET_TURNS, QUIET_PAUSE_S, QUIET_TOKENS = 3, 4, 0.5, 16
NOISY_CONVERSATIONS, NOISY_TURNS, NOISY_TOKENS, DOC_WORDS = 8, 3, 64, 600


@dataclass
class Reply:
    tenant: str
    conversation: str
    turn: int
    status: int
    ttft_s: float | None
    replica: str
    generated: int
    cache_n: int
    waited_ms: float | None
    finished: float


@dataclass
class Phase:
    replies: list[Reply] = field(default_factory=list)
    started: float = 0.0
    objectives: dict[str, str] = field(default_factory=dict)  # tenant -> the objective its requests name


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:18000", help="the gateway (llm-ring up's)")
    parser.add_argument("--rounds", type=int, default=1, help="alone + flood, this many times")
    parser.add_argument("--quiet-after", type=float, default=3.0, help="seconds into the flood the quiet tenant starts")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--objectives", action="store_true", help="the quiet tenant names the objective "
                        "'interactive', the noisy one 'batch' (router.toml's bands 10 and -10)")
    parser.add_argument("--step-bound", metavar="REPLICA_URL", default="",
                        help="measure one replica's batch-step bound instead (its API key: --key-file)")
    parser.add_argument("--key-file", default="", help="--step-bound: the replica's API key file")


def main(args: argparse.Namespace) -> int:
    try:
        if args.step_bound:
            key = _key(args.key_file)
            result = asyncio.run(step_bound(args.step_bound, key, args.seed))
        else:
            objectives = {"quiet": "interactive", "noisy": "batch"} if args.objectives else {}
            result = asyncio.run(scenario(args.url, args.rounds, args.quiet_after, args.seed, objectives))
    except (OSError, httpx.HTTPError) as error:
        where = args.step_bound or args.url
        print(f"llm-ring bench flow: {where}: {error or type(error).__name__}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else render(result))
    return 0


def _key(key_file: str) -> str:
    if not key_file:
        raise OSError("--step-bound needs --key-file (the replica's API key: <run dir>/replica-api-key)")
    return Path(key_file).read_text().strip()


def render(result: dict[str, Any]) -> str:
    """The result as a table: one row a figure, a column a phase (or the step bound's figures)."""
    if "alone" not in result:
        return "\n".join(f"{name:<28} {value}" for name, value in result.items())
    lines = [f"{'':<36} {'alone':>10} {'flood':>10}"]
    lines += [f"{name:<36} {_shown(result['alone'][name]):>10} {_shown(result['flood'][name]):>10}"
              for name in result["alone"]]
    lines.append(f"quiet tenant's p95 TTFT, flood / alone: {result['quiet_p95_ratio']}")
    return "\n".join(lines)


def _shown(value: object) -> str:
    return "-" if value is None else str(value)


async def scenario(url: str, rounds: int, quiet_after: float, seed: int,
                   objectives: dict[str, str]) -> dict[str, Any]:
    """objectives: tenant -> the objective its requests name (none: the default band)."""
    alone, flood = [], []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        for index in range(rounds):
            rng = random.Random(seed * 1000 + index)
            alone.append(await _phase(client, rng, objectives, flood=False, quiet_after=0.0))
            flood.append(await _phase(client, rng, objectives, flood=True, quiet_after=quiet_after))
    return {"alone": summary(alone), "flood": summary(flood),
            "quiet_p95_ratio": _ratio(summary(flood)["quiet_ttft_p95_s"], summary(alone)["quiet_ttft_p95_s"])}


async def _phase(client: httpx.AsyncClient, rng: random.Random, objectives: dict[str, str], flood: bool,
                 quiet_after: float) -> Phase:
    phase = Phase(started=time.monotonic(), objectives=objectives)
    session = secrets.token_hex(4)
    tasks = []
    if flood:
        tasks += [asyncio.create_task(_noisy(client, rng, session, index, phase))
                  for index in range(NOISY_CONVERSATIONS)]
        await asyncio.sleep(quiet_after)
    tasks += [asyncio.create_task(_quiet(client, rng, session, index, phase)) for index in range(QUIET_CHATS)]
    await asyncio.gather(*tasks)
    return phase


async def _quiet(client: httpx.AsyncClient, rng: random.Random, session: str, index: int, phase: Phase) -> None:
    messages = [session_message(f"{session}-quiet-{index}")]
    for turn in range(1, QUIET_TURNS + 1):
        messages.append({"role": "user", "content": sentence(rng, 12)})
        answer = await _send(client, "quiet", f"{session}-q{index}", turn, messages, QUIET_TOKENS, phase)
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(QUIET_PAUSE_S)


async def _noisy(client: httpx.AsyncClient, rng: random.Random, session: str, index: int, phase: Phase) -> None:
    messages = [session_message(f"{session}-noisy-{index}"),
                {"role": "user", "content": "Summarise this document:\n\n" + paragraphs(rng, DOC_WORDS)}]
    for turn in range(1, NOISY_TURNS + 1):
        if turn > 1:
            messages.append({"role": "user", "content": sentence(rng, 12)})
        answer = await _send(client, "noisy", f"{session}-n{index}", turn, messages, NOISY_TOKENS, phase)
        messages.append({"role": "assistant", "content": answer})


async def _send(client: httpx.AsyncClient, tenant: str, conversation: str, turn: int,
                messages: list[dict[str, str]], max_tokens: int, phase: Phase) -> str:
    headers = {TENANT_HEADER: tenant, "x-conversation-id": conversation, "x-turn": str(turn)}
    if tenant in phase.objectives:
        headers[OBJECTIVE_HEADER] = phase.objectives[tenant]
    started, ttft, answer = time.monotonic(), None, Answer()
    async with client.stream("POST", CHAT, json=request_body(messages, max_tokens, True, ""),
                             headers=headers) as reply:
        async for line in reply.aiter_lines():
            if read_sse_line(line, answer) and ttft is None:
                ttft = time.monotonic() - started
        waited = reply.headers.get("x-route-queue-wait-ms")
        phase.replies.append(Reply(
            tenant, conversation, turn, reply.status_code, ttft, reply.headers.get("x-routed-to", ""),
            int(answer.timings.get("predicted_n", 0)), int(answer.timings.get("cache_n", 0)),
            float(waited) if waited else None, time.monotonic()))
    return answer.content


def summary(phases: list[Phase]) -> dict[str, Any]:
    replies = [reply for phase in phases for reply in phase.replies]
    quiet = [reply for reply in replies if reply.tenant == "quiet"]
    ttfts = sorted(reply.ttft_s for reply in quiet if reply.ttft_s is not None)
    followups = [(reply, _previous(replies, reply)) for reply in quiet if reply.turn > 1]
    spans = sum(max(reply.finished for reply in phase.replies) - phase.started for phase in phases)
    waits = [reply.waited_ms for reply in quiet if reply.waited_ms is not None]
    return {
        "quiet_requests": len(quiet), "quiet_ok": sum(reply.status == 200 for reply in quiet),
        "quiet_ttft_p50_s": _quantile(ttfts, 0.5), "quiet_ttft_p95_s": _quantile(ttfts, 0.95),
        "quiet_wait_p95_ms": _quantile(sorted(waits), 0.95) if waits else None,
        "quiet_followups": len(followups),
        "quiet_followups_on_their_replica": sum(prev is not None and prev.replica == reply.replica
                                                for reply, prev in followups),
        "noisy_answers": sum(reply.tenant == "noisy" and reply.status == 200 for reply in replies),
        "noisy_followups_on_their_replica": sum(
            (prev := _previous(replies, reply)) is not None and prev.replica == reply.replica
            for reply in replies if reply.tenant == "noisy" and reply.turn > 1),
        "refused": sum(reply.status != 200 for reply in replies),
        "answered_tokens_per_s": round(sum(reply.generated for reply in replies) / spans, 2) if spans else None,
    }


def _previous(replies: list[Reply], reply: Reply) -> Reply | None:
    return next((other for other in replies if other.conversation == reply.conversation
                 and other.turn == reply.turn - 1), None)


def _quantile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    position = (len(values) - 1) * q
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return round(values[low] + (values[high] - values[low]) * (position - low), 4)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


async def step_bound(replica: str, key: str, seed: int, samples: int = 12) -> dict[str, Any]:
    """A short request's TTFT on an idle replica, then sent at random moments while one pasted
    document is prefilled there: the extra wait is what one noisy request in the batch costs."""
    rng = random.Random(seed)
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=replica, headers=headers, timeout=600) as client:
        alone = [await _short(client, rng) for _ in range(samples)]
        beside = []
        for _ in range(samples):
            document = [session_message(secrets.token_hex(4)),
                        {"role": "user", "content": "Summarise:\n\n" + paragraphs(rng, DOC_WORDS)}]
            noisy = asyncio.create_task(client.post(CHAT, json=request_body(document, 1, False, "")))
            await asyncio.sleep(rng.uniform(0.05, 1.0))
            beside.append(await _short(client, rng))
            reply = await noisy
            prefill_s = reply.json()["timings"]["prompt_ms"] / 1000
        return {"alone_ttft_p50_s": _quantile(sorted(alone), 0.5), "alone_ttft_p95_s": _quantile(sorted(alone), 0.95),
                "beside_ttft_p50_s": _quantile(sorted(beside), 0.5),
                "beside_ttft_p95_s": _quantile(sorted(beside), 0.95),
                "bound_p95_ratio": _ratio(_quantile(sorted(beside), 0.95), _quantile(sorted(alone), 0.95)),
                "document_prefill_s": round(prefill_s, 3), "mean_extra_s": round(statistics.mean(beside)
                                                                                 - statistics.mean(alone), 3)}


async def _short(client: httpx.AsyncClient, rng: random.Random) -> float:
    messages = [session_message(secrets.token_hex(4)), {"role": "user", "content": sentence(rng, 12)}]
    started = time.monotonic()
    async with client.stream("POST", CHAT, json=request_body(messages, QUIET_TOKENS, True, "")) as reply:
        async for line in reply.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                return time.monotonic() - started
    raise RuntimeError(f"no token from {client.base_url} (status {reply.status_code})")
