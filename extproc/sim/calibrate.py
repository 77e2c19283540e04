"""`llm-ring calibrate`: measure a live llama.cpp replica into a cost-model JSON.

Talks to the replica's own HTTP API (``/completion`` with ``cache_prompt`` and
``ignore_eos``; the ``timings`` object gives prompt_n, cache_n, prompt_ms,
predicted_n, predicted_ms). Either point it at a running replica (``--url``) or let it
start one with xllamacpp (``--model``, in this process, on a loopback port).

What is measured (each step prints what it found):
1. cold prefill: fresh prompts of several lengths (a unique first word defeats any cache);
2. cached prefill: the same prompts again (llama.cpp re-evaluates >= 1 token);
   both fitted by least squares to ``overhead + a*new + b*new*(cached + new/2)``,
   the overhead also taking the HTTP round trip (wall time minus server timings);
3. decode: ``--decode-tokens`` answers after a short and a long prompt (per-token time
   and its growth with context);
4. concurrency: k = 1..slots simultaneous requests, decode-heavy and prefill-heavy
   separately; slowdown(k) = mean per-request time at k / time alone.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from extproc.migration.llama import key_headers
from extproc.settings import read_secret_file
from extproc.sim.costmodel import parse_cost_model

WORDS = ("river", "stone", "paper", "light", "garden", "window", "morning", "silver", "market", "answer",
         "travel", "orange", "letter", "forest", "simple", "button", "winter", "corner", "pocket", "dinner")


def configure(parser: argparse.ArgumentParser) -> None:
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a running replica, e.g. http://127.0.0.1:18001")
    target.add_argument("--from-records", type=Path, metavar="DIR",
                        help="fit the timings of a live experiment folder instead (concurrency included)")
    target.add_argument("--model", type=Path, help="a GGUF file: start an xllamacpp replica for the measurement")
    parser.add_argument("--api-key-file", type=Path, metavar="FILE",
                        help="--url: the file holding the replica's API key (a local stack's: "
                             "<run dir>/replica-api-key)")
    parser.add_argument("--port", type=int, default=0, help="--model: loopback port (default: a free one)")
    parser.add_argument("--slots", type=int, default=4, help="--model: --parallel; also the concurrency measured")
    parser.add_argument("--threads", type=int, default=2, help="--model: CPU threads")
    parser.add_argument("--ctx-per-slot", type=int, default=4096, help="--model: context per slot")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 256, 1024],
                        help="prompt lengths (approximate tokens) for the prefill fit")
    parser.add_argument("--repeats", type=int, default=3, help="measurements per point (the fastest is kept)")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--name", required=True, help="cost model name (the file's stem)")
    parser.add_argument("--kv-bytes-per-token", type=int, required=True,
                        help="KV cache bytes per token (12288 for Qwen2.5-0.5B shapes)")
    parser.add_argument("--note", default="", help="free text recorded in the file's 'measured' block")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")


def main(args: argparse.Namespace) -> int:
    server = None
    url = args.url
    if args.from_records is not None:
        model = fit_records(args.from_records, args)
    else:
        headers = {}
        if args.model is not None:
            server, url = _start_replica(args)
        elif args.api_key_file is not None:
            headers = key_headers(read_secret_file("--api-key-file", str(args.api_key_file)))
        with httpx.Client(base_url=url, timeout=600, headers=headers) as client:
            _wait_healthy(client)
            model = calibrate(client, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(model, indent=2) + "\n")
    parse_cost_model(model, source=str(args.out))  # the file must load
    print(f"wrote {args.out}", file=sys.stderr)
    del server
    return 0


def _prefill_points(
    client: httpx.Client, rng: random.Random, args: argparse.Namespace
) -> tuple[list[tuple[float, float, float]], list[float]]:
    """A cold and a cached prompt of each length: (new, cached, prompt seconds) of each, and the
    time each answer took beyond its prompt and generation (the HTTP overhead)."""
    rows = []  # (new, cached, prompt_s)
    overheads = []
    for length in args.lengths:
        # The fastest of the repeats: on a shared CPU, other load only ever adds time.
        colds, warms = [], []
        for _ in range(args.repeats):
            prompt = _prompt(rng, length)
            colds.append(_complete(client, prompt, 1))
            warms.append(_complete(client, prompt, 1))
        cold = min(colds, key=lambda t: t["prompt_ms"])
        warm = min(warms, key=lambda t: t["prompt_ms"])
        for t in (cold, warm):
            rows.append((t["prompt_n"], t["cache_n"], t["prompt_ms"] / 1000))
            overheads.append(t["wall_s"] - (t["prompt_ms"] + t["predicted_ms"]) / 1000)
        _log(f"prefill ~{length} tok: cold {cold['prompt_n']} tok {cold['prompt_ms']:.0f} ms, "
             f"cached {warm['cache_n']}+{warm['prompt_n']} tok {warm['prompt_ms']:.0f} ms")
    return rows, overheads


def _decode_points(client: httpx.Client, rng: random.Random, args: argparse.Namespace) -> list[tuple[float, float]]:
    """Seconds per generated token after a short and after a long context: (context, s/token) of each."""
    decode = []
    for length in (16, max(args.lengths) // 2):
        t = _fastest([_complete(client, _prompt(rng, length), args.decode_tokens) for _ in range(args.repeats)])
        decode.append((t["prompt_n"] + t["cache_n"], t["predicted_ms"] / 1000 / max(1, t["predicted_n"])))
        _log(f"decode after {decode[-1][0]} tok: {1 / decode[-1][1]:.1f} tok/s")
    return decode


def calibrate(client: httpx.Client, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    log = _log
    rows, overheads = _prefill_points(client, rng, args)
    x = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in rows])
    y = np.array([s for _, _, s in rows])
    intercept, per_token, per_ctx = (max(0.0, float(v)) for v in np.linalg.lstsq(x, y, rcond=None)[0])
    http = max(0.0, float(np.median(overheads)))
    decode = _decode_points(client, rng, args)
    (ctx_a, per_a), (ctx_b, per_b) = decode
    per_tok_ctx = max(0.0, (per_b - per_a) / (ctx_b - ctx_a)) if ctx_b > ctx_a else 0.0
    per_tok = per_a - ctx_a * per_tok_ctx
    if per_tok <= 0:  # noise made the context slope swallow the base cost: keep a flat per-token cost
        per_tok_ctx, per_tok = 0.0, min(per_a, per_b)

    slots = args.slots
    decode_slow = _concurrency(client, rng, slots, args.repeats, 16, args.decode_tokens,
                               lambda t: t["predicted_ms"] / max(1, t["predicted_n"]))
    log(f"decode slowdown by busy slots: {decode_slow}")
    prefill_slow = _concurrency(client, rng, slots, args.repeats, min(512, max(args.lengths)), 1,
                                lambda t: t["prompt_ms"])
    log(f"prefill slowdown by busy slots: {prefill_slow}")
    return {
        "name": args.name,
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "prefill": {"overhead_s": round(intercept + http, 6), "per_token_s": per_token, "per_token_ctx_s": per_ctx},
        "decode": {"per_token_s": per_tok, "per_token_ctx_s": per_tok_ctx},
        "concurrency": {"prefill_slowdown": prefill_slow, "decode_slowdown": decode_slow},
        "measured": {
            "how": "llm-ring calibrate (extproc/sim/calibrate.py): /completion timings, least-squares fit",
            "target": args.url or str(args.model),
            "slots": slots,
            "threads": args.threads if args.model else None,
            "lengths": args.lengths,
            "repeats": args.repeats,
            "http_overhead_s": http,
            "points": [{"new": n, "cached": c, "prompt_s": round(s, 5)} for n, c, s in rows],
            "decode_points": [{"context": c, "s_per_token": round(s, 6)} for c, s in decode],
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "note": args.note,
        },
    }


def fit_records(experiment: Path, args: argparse.Namespace) -> dict[str, Any]:
    """A cost model from a live run's own per-request timings (llama.cpp's prompt_ms, predicted_ms).

    Those timings were taken under the run's real concurrency and machine load, so the
    fit already contains the slowdown: the slowdown tables are left at 1 (no double count).
    """
    import duckdb

    files = sorted(str(p) for p in experiment.glob("*/requests.parquet"))
    if not files:
        raise SystemExit(f"llm-ring calibrate: {experiment}: no */requests.parquet")
    points = duckdb.execute(
        "SELECT prompt_n, cache_n, prompt_ms / 1000, predicted_n, predicted_ms / 1000, "
        "latency_s - (prompt_ms + predicted_ms) / 1000 FROM read_parquet($f) "
        "WHERE status = 200 AND error IS NULL AND prompt_n IS NOT NULL AND predicted_n > 0",
        {"f": files},
    ).fetchall()
    x = np.array([[1.0, n, n * (c + n / 2)] for n, c, *_ in points])
    y = np.array([p[2] for p in points])
    intercept, per_token, per_ctx = (max(0.0, float(v)) for v in np.linalg.lstsq(x, y, rcond=None)[0])
    per_decode = sum(p[4] for p in points) / sum(p[3] for p in points)
    return {
        "name": args.name,
        "kv_bytes_per_token": args.kv_bytes_per_token,
        "prefill": {"overhead_s": intercept, "per_token_s": per_token, "per_token_ctx_s": per_ctx},
        "decode": {"per_token_s": per_decode, "per_token_ctx_s": 0.0},
        "concurrency": {"prefill_slowdown": [1.0], "decode_slowdown": [1.0]},
        "measured": {
            "how": "llm-ring calibrate --from-records: least squares over a live experiment's request timings "
                   "(taken under that run's concurrency and machine load; slowdown tables left at 1)",
            "records": str(experiment),
            "requests": len(points),
            "median_wait_outside_llama_s": float(np.median([p[5] for p in points])),
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "note": args.note,
        },
    }


def _concurrency(client: httpx.Client, rng: random.Random, slots: int, repeats: int, length: int,
                 n_predict: int, measure: Any) -> list[float]:
    """Mean per-request time with k requests at once (fastest repeat), over the time alone (k = 1..slots)."""
    times = []
    for k in range(1, slots + 1):
        best = float("inf")
        for _ in range(repeats):
            prompts = [_prompt(rng, length) for _ in range(k)]
            with ThreadPoolExecutor(k) as pool:
                results = list(pool.map(lambda p: _complete(client, p, n_predict), prompts))
            best = min(best, sum(measure(t) for t in results) / k)
        times.append(best)
    return [round(max(1.0, t / times[0]), 3) for t in times]


def _complete(client: httpx.Client, prompt: str, n_predict: int) -> dict[str, float]:
    started = time.perf_counter()
    response = client.post("/completion", json={
        "prompt": prompt, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": True,
        "temperature": 0.0, "stream": False,
    })
    wall = time.perf_counter() - started
    response.raise_for_status()
    timings = response.json()["timings"]
    return {"wall_s": wall, "prompt_n": timings["prompt_n"], "cache_n": timings.get("cache_n", 0),
            "prompt_ms": timings["prompt_ms"], "predicted_n": timings["predicted_n"],
            "predicted_ms": timings["predicted_ms"]}


def _fastest(results: list[dict[str, float]]) -> dict[str, float]:
    return min(results, key=lambda t: t["predicted_ms"] / max(1, t["predicted_n"]))


def _prompt(rng: random.Random, tokens: int) -> str:
    # A unique first word: no two prompts share a prefix, so "cold" is really cold.
    head = f"{rng.randrange(10**9)} "
    return head + " ".join(rng.choice(WORDS) for _ in range(max(1, tokens - 4)))


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _wait_healthy(client: httpx.Client, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if client.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"replica at {client.base_url} not healthy after {timeout_s:.0f} s")


def _start_replica(args: argparse.Namespace) -> tuple[Any, str]:
    import socket

    import xllamacpp

    port = args.port
    if port == 0:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    params = xllamacpp.CommonParams()
    params.model.path = str(args.model)
    params.port = port
    params.hostnames = ["127.0.0.1"]
    params.n_parallel = args.slots
    params.n_ctx = args.ctx_per_slot * args.slots
    params.cpuparams.n_threads = args.threads
    params.cpuparams_batch.n_threads = args.threads
    params.cache_ram_mib = 512
    server = xllamacpp.Server(params)
    return server, f"http://127.0.0.1:{port}"
