"""Hand-made experiment folders with known answers (real parquet through write_records)."""

from __future__ import annotations

from pathlib import Path

from extproc.records import RunMeta, write_records, write_run_metadata

T0 = 1_800_000_000.0


def request(run, policy, seed, conv, turn, replica, cache_n, prompt_n, *, at, latency=1.0,
            status=200, error=None, ttft=None, reason="home"):  # fmt: skip
    return dict(
        run_id=run, policy=policy, seed=seed, simulated=True, conversation=conv, turn=turn,
        replica=replica, route_reason=reason, cache_n=cache_n, prompt_n=prompt_n,
        latency_s=latency, ttft_s=ttft, status=status, error=error,
        started_at=T0 + at, finished_at=T0 + at + latency,
    )  # fmt: skip


def write_run(root: Path, run: str, policy: str, seed: int, rows: list[dict], scale_ready_s=None):
    write_records(rows, root / run / "requests.parquet")
    meta = RunMeta(
        run_id=run, policy=policy, seed=seed, simulated=True, profile={}, routing={"policy": policy},
        replicas_start=2, started_at="2027-01-15T08:00:00+00:00",
    )  # fmt: skip
    if scale_ready_s is not None:
        from datetime import UTC, datetime

        meta.scale_ready_at = datetime.fromtimestamp(T0 + scale_ready_s, UTC).isoformat()
        meta.scaled_to = 3
    write_run_metadata(meta, root / run)


def known_run(run="bounded-s1", policy="bounded", seed=1):
    """4 follow-ups: 2 hits, 1 avoidable miss (redirect), 1 eviction miss; 1 error."""
    r = lambda *a, **k: request(run, policy, seed, *a, **k)  # noqa: E731
    return [
        r("c1", 1, "llm-0", 0, 100, at=0, latency=1.0),
        r("c1", 2, "llm-0", 100, 30, at=2, latency=2.0),  # hit
        r("c1", 3, "llm-1", 5, 160, at=4, latency=3.0, reason="overflow"),  # avoidable miss
        r("c1", 4, "llm-1", 160, 20, at=6, latency=4.0),  # hit, same replica
        r("c2", 1, "llm-1", 0, 50, at=0, latency=5.0),
        r("c2", 2, "llm-1", 10, 70, at=2, latency=6.0),  # miss on the same replica: eviction
        r("c2", 3, None, None, None, at=4, latency=0.1, status=503, error="no replica"),
        r("c2", 4, "llm-1", 100, 10, at=6, latency=7.0),  # previous turn failed: no follow-up
    ]


def make_experiment(root: Path, runs: int = 3, conversations: int = 12, turns: int = 6) -> Path:
    """A bigger synthetic experiment (2 policies x `runs` seeds, scale-up at t=10 s) for notebooks."""
    import random

    for seed in range(1, runs + 1):
        for policy, stay in (("bounded", 0.8), ("llm-aware", 0.95)):
            rng = random.Random(f"{policy}{seed}")
            run = f"{policy}-s{seed}"
            rows = []
            for c in range(conversations):
                replica, history = f"llm-{c % 2}", 0
                for turn in range(1, turns + 1):
                    at = c * 0.5 + turn * 3.0
                    moved = turn > 1 and rng.random() > stay
                    if moved or (at >= 10 and turn > 1 and rng.random() < 0.2):
                        replica = f"llm-{rng.randrange(3 if at >= 10 else 2)}"
                    cache = history if turn > 1 and not moved else 0
                    prompt = history + 40 - cache
                    rows.append(request(run, policy, seed, f"c{c}", turn, replica, cache, prompt,
                                        at=at, latency=0.2 + prompt / 100, ttft=0.1 + prompt / 200))  # fmt: skip
                    history += 40 + 16
            write_run(root, run, policy, seed, rows, scale_ready_s=10.0)
    return root
