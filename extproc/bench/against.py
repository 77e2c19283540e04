"""`llm-ring bench decisions --against DIR`: this checkout's decision times beside another's.

A change of a few per cent cannot be seen by running the benchmark twice on these shared
machines: one run's cell differs from the next by 30 % and more. Here both checkouts run in
a worker process each, pinned to the same CPU, and every cell is timed in pairs: this side,
then the other, then the other first, ``rounds`` times. The figure is the median of the pairs'
ratios: each pair ran within a fraction of a second, so a slow moment of the machine falls on
both sides of it. One process's own layout (its string hashes, where its heap landed) moved a
cell by up to 8 % from one pair of workers to the next, so each cell's pairs are spread over
``PROCESSES`` fresh pairs of workers, the two of a pair started with the same ``PYTHONHASHSEED``.
The other checkout needs only ``extproc.bench.decisions``'s ``time_decisions(spec, replicas,
decisions)``; its routing core is chosen by the same ``LLM_RING_CORE`` as this one's (compiled:
it must be built there too).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from extproc.cli_input import UsageError

SLOWER_THAN = 1.05  # a ratio above this is called out: a change should keep each cell within 5 %
PROCESSES = 3  # fresh pairs of workers per cell (at most one per pair of timings)

# Runs in each worker, on the checkout's own code: one cell per line in, its figures out.
WORKER = """
import json, os, sys
cpu = int(sys.argv[1])
if cpu >= 0:
    os.sched_setaffinity(0, {cpu})
from extproc.bench.decisions import time_decisions
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    spec, replicas, decisions = line.split()
    try:
        print(json.dumps(time_decisions(spec, int(replicas), int(decisions))), flush=True)
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
"""


class Worker:
    """One checkout's worker process (WORKER above)."""

    def __init__(self, name: str, checkout: Path, cpu: int, hash_seed: int) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": str(checkout), "PYTHONHASHSEED": str(hash_seed)}
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER, str(cpu)], cwd=checkout, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )  # fmt: skip
        if self._answer() is None:
            raise UsageError(f"--against: the worker of {name} did not start: {self._last_error()}")

    def time(self, spec: str, replicas: int, decisions: int) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(f"{spec} {replicas} {decisions}\n")
        self.process.stdin.flush()
        answer = self._answer()
        if answer is None:
            raise UsageError(f"--against: the worker of {self.name} stopped: {self._last_error()}")
        return answer

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait(10)

    def _answer(self) -> dict[str, Any] | None:
        """The worker's next JSON line (anything else its checkout prints is passed over); None: it ended."""
        stdout: IO[str] | None = self.process.stdout
        while stdout is not None and (line := stdout.readline()):
            if line.startswith("{"):
                answer: dict[str, Any] = json.loads(line)
                return answer
        return None

    def _last_error(self) -> str:
        self.process.wait(10)
        err = self.process.stderr.read() if self.process.stderr is not None else ""
        lines = [line for line in err.strip().splitlines() if line.strip()]
        return lines[-1] if lines else f"exit code {self.process.returncode}"


def checkout(path: str) -> Path:
    """``--against``'s folder, checked: an llm-ring checkout with the decisions benchmark."""
    folder = Path(path).resolve()
    if not (folder / "extproc" / "bench" / "decisions.py").is_file():
        raise UsageError(f"--against {path}: not an llm-ring checkout (no extproc/bench/decisions.py there)")
    return folder


def shared_cpu() -> int:
    """The CPU both workers are pinned to (the last this process may use; -1: no pinning here)."""
    if not hasattr(os, "sched_getaffinity"):
        return -1
    return max(os.sched_getaffinity(0))


def paired_cells(here: Path, other: Path, cells: Sequence[tuple[str, int, int]], rounds: int,
                 progress: Any = None) -> list[dict[str, Any]]:
    """Each (spec, replicas, decisions) cell timed ``rounds`` times on both checkouts, in pairs
    whose order alternates; a cell the other checkout cannot run carries its error."""
    cpu = shared_cpu()
    results = []
    for spec, replicas, decisions in cells:
        row = _paired(here, other, cpu, spec, replicas, decisions, rounds)
        results.append(row)
        if progress is not None:
            progress(row)
    return results


def _paired(here: Path, other: Path, cpu: int, spec: str, replicas: int, decisions: int,
            rounds: int) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": spec, "replicas": replicas}
    medians: dict[str, list[float]] = {"here": [], "other": []}
    processes = min(PROCESSES, rounds)
    for seed in range(processes):
        workers = {"here": Worker(str(here), here, cpu, seed)}
        try:
            workers["other"] = Worker(str(other), other, cpu, seed)
            for turn in range(seed, rounds, processes):  # this pair's share of the rounds
                for side in ("here", "other") if turn % 2 == 0 else ("other", "here"):
                    answer = workers[side].time(spec, replicas, decisions)
                    if "error" in answer:
                        return {**row, "error": f"{side}: {answer['error']}"}
                    medians[side].append(answer["median_us"])
        finally:
            for worker in workers.values():
                worker.close()
    ratios = [a / b for a, b in zip(medians["here"], medians["other"], strict=True)]
    return {**row, "here_us": statistics.median(medians["here"]), "other_us": statistics.median(medians["other"]),
            "ratio": statistics.median(ratios), "lowest": min(ratios), "highest": max(ratios)}


def render_row(row: dict[str, Any]) -> str:
    head = f"  {row['policy']:<28} {row['replicas']:>5} replicas"
    if "error" in row:
        return f"{head}  not compared ({row['error']})"
    flag = "  slower by more than 5 %" if row["ratio"] > SLOWER_THAN else ""
    return (f"{head}  here {row['here_us']:7.2f} µs  there {row['other_us']:7.2f} µs  "
            f"ratio {row['ratio']:.3f} [{row['lowest']:.2f}-{row['highest']:.2f}]{flag}")
