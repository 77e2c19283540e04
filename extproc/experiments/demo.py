"""`llm-ring demo` (`make demo`): model, local stack, a short policy comparison, the summary table.

Steps, each announced: prepare the model (nothing from a model hub) -> start replicas, the
routing service and Envoy on free loopback ports -> run the same multi-turn chat traffic
under each policy with the experiment runner -> print the report -> stop the stack (also
on Ctrl-C or an error). The experiment folder stays for `llm-ring report DIR`.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from extproc.stack import models

STEPS = 4


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help=f"{' | '.join(models.MODELS)}")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--profile", default="quick", help="traffic profile (name or JSON path)")
    parser.add_argument("--policies", nargs="+", default=["bounded", "llm-aware"], metavar="POLICY")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1], metavar="SEED")
    parser.add_argument("--out-dir", type=Path, help="experiment folder (default <data dir>/demo/<time>)")
    parser.add_argument("--data-dir", help=f"models etc. (${models.DATA_ENV}, default ~/.local/share/llm-ring)")


def main(args: argparse.Namespace) -> int:
    from extproc.analysis.report import SUMMARY_FILE, build_report, render_markdown, render_table
    from extproc.experiments.lab import LabError
    from extproc.experiments.run import ExperimentError, run_experiment
    from extproc.stack.commands import FAILURES
    from extproc.stack.lab import LocalLab
    from extproc.stack.stack import load_stack_settings
    from extproc.traffic import ProfileError, load_profile

    began = time.monotonic()
    data = models.data_dir(args.data_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = args.out_dir or data / "demo" / stamp
    try:
        profile = load_profile(args.profile)
        _step(1, f"model {args.model}")
        models.prepare(args.model, data, _say)
        _step(2, f"local stack: {args.replicas} replicas + routing service + Envoy")
        settings = load_stack_settings(overrides={
            "replicas": {"count": args.replicas, "model": args.model},
            "ports": {"gateway": 0, "envoy_admin": 0, "router": 0, "metrics": 0, "replica_base": 0},
            "check": {"profile": args.profile},
        })
        with LocalLab.start(settings, data, data / "demo" / f"run-{stamp}", _say) as lab:
            _step(3, f"{' vs '.join(args.policies)} on profile {profile.name}, seeds {args.seeds} "
                     f"via {lab.gateway_url}")
            run_experiment(lab, profile, args.policies, args.seeds, out, progress=_say)
        _step(4, f"report of {out}")
        report = build_report(out)
        (out / SUMMARY_FILE).write_text(render_markdown(report, with_runs=True))
    except (*FAILURES, ProfileError, ExperimentError, LabError) as exc:
        print(f"llm-ring demo: {exc}", file=sys.stderr)
        return 1
    print(render_table(report), end="")
    print(f"\ndemo done in {time.monotonic() - began:.0f}s; details: {out / SUMMARY_FILE} "
          f"(again: llm-ring report {out})")
    return 0


def _step(number: int, text: str) -> None:
    _say(f"[demo {number}/{STEPS}] {text}")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
