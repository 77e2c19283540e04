"""Measure the local stack: start-up time, memory per replica, cold vs cached prompts.

    python -m extproc.stack.measure --model smollm2 [--model qwen2.5-0.5b-shape] [--json]

For each model: start a stack of --replicas replicas on free ports (timed until Envoy is
ready), send one warm-up request per replica, then for each prompt size send a fresh
prompt (cold: nothing cached but the chat template) and the very same prompt again
(cached: everything but the last token is in the slot), through Envoy, one request at a
time, --repeats times with new text. Reports the server's own prompt time
(timings.prompt_ms), the client's end-to-end time through Envoy, and replica RSS
(the weights are mmapped: replicas of one model share those pages, RSS counts them in each).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from extproc.stack import models
from extproc.stack.lab import LocalLab
from extproc.stack.settings import load_stack_settings
from extproc.traffic.words import paragraphs

CHAT = "/v1/chat/completions"
FREE_PORTS = {"gateway": 0, "envoy_admin": 0, "router": 0, "metrics": 0, "replica_base": 0}
WORDS_FOR = {30: 16, 1000: 900}  # prompt tokens wanted -> filler words (~1.1 tokens a word + template)


def measure_model(model: str, replicas: int, threads: int | None, repeats: int, say: Any) -> dict[str, Any]:
    settings = load_stack_settings(overrides={"replicas": {"count": replicas, "model": model, "threads": threads},
                                              "ports": FREE_PORTS})
    with tempfile.TemporaryDirectory(prefix="llm-ring-measure-") as run, \
            LocalLab.start(settings, run=Path(run), progress=say) as lab:
        for name, address in lab.replicas().items():
            _ask(f"http://{address}", f"warm-{name}", "warm up", 1)
        result: dict[str, Any] = {
            "model": model,
            "replicas": replicas,
            "threads": settings.replicas.threads,
            "startup_s": round(lab.stack.state.startup_seconds, 2),
            "rss_mib": {r["name"]: r["rss_mib"] for r in lab.stack.status()["replicas"]},
            "prompts": [],
        }
        rng = random.Random(7)
        for wanted, words in WORDS_FOR.items():
            rows = []
            for attempt in range(repeats):
                text = paragraphs(rng, words)
                conversation = f"measure-{model}-{wanted}-{attempt}-{time.time_ns()}"
                cold = _ask(lab.gateway_url, conversation, text, 1)
                cached = _ask(lab.gateway_url, conversation, text, 1)
                rows.append((cold, cached))
                say(f"{model} ~{wanted} tokens #{attempt + 1}: {cold['prompt_tokens']} tokens, cold "
                    f"{cold['prompt_ms']:.0f} ms, cached {cached['prompt_ms']:.0f} ms (cache_n {cached['cache_n']})")
            result["prompts"].append({
                "prompt_tokens": rows[0][0]["prompt_tokens"],
                "cold_prompt_ms": _median(r[0]["prompt_ms"] for r in rows),
                "cached_prompt_ms": _median(r[1]["prompt_ms"] for r in rows),
                "cold_client_ms": _median(r[0]["client_ms"] for r in rows),
                "cached_client_ms": _median(r[1]["client_ms"] for r in rows),
                "cached_tokens": rows[0][1]["cache_n"],
                "repeats": repeats,
            })
        result["rss_mib_after"] = {r["name"]: r["rss_mib"] for r in lab.stack.status()["replicas"]}
    return result


def _ask(base: str, conversation: str, text: str, max_tokens: int) -> dict[str, Any]:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "ignore_eos": True}
    began = time.perf_counter()
    reply = httpx.post(base + CHAT, json=body, headers={"x-conversation-id": conversation}, timeout=300)
    client_ms = (time.perf_counter() - began) * 1000
    reply.raise_for_status()
    answer = reply.json()
    timings = answer["timings"]
    return {"prompt_tokens": answer["usage"]["prompt_tokens"], "prompt_ms": timings["prompt_ms"],
            "cache_n": timings["cache_n"], "client_ms": client_ms}


def _median(values: Any) -> float:
    return round(statistics.median(values), 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=sorted(models.MODELS))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--threads", type=int, help="threads per replica (default: stack.toml)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args(argv)
    results = [measure_model(m, args.replicas, args.threads, args.repeats, _say)
               for m in args.model or [models.DEFAULT_MODEL]]
    if args.json:
        print(json.dumps({"results": results}))
        return 0
    for result in results:
        rss = ", ".join(f"{n} {v:.0f}" for n, v in result["rss_mib_after"].items())
        print(f"{result['model']}: stack start-up {result['startup_s']:.1f} s ({result['replicas']} replicas, "
              f"{result['threads']} thread(s) each); "
              f"RSS MiB {rss}")
        for p in result["prompts"]:
            print(f"  {p['prompt_tokens']:>5} tokens: server prompt {p['cold_prompt_ms']:.0f} ms cold vs "
                  f"{p['cached_prompt_ms']:.0f} ms cached ({p['cached_tokens']} cached); through Envoy "
                  f"{p['cold_client_ms']:.0f} ms vs {p['cached_client_ms']:.0f} ms (median of {p['repeats']})")
    return 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
