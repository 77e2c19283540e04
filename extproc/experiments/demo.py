"""`llm-ring demo` (`make demo`): a short live comparison, and the simulator's answer beside it.

Steps, each announced: prepare the model -> start replicas, the routing service and Envoy
on free loopback ports -> run the same multi-turn chat traffic under each policy with the
experiment runner (one seed: a live run on a small machine is a smoke test, not evidence)
-> simulate the very same conversations on the same fleet over many seeds, and the `busy`
profile, where replicas stay over the bounded cap and the policies really differ -> print
the live and simulated tables side by side and, per simulated profile, one sentence that
says which paired differences are within noise; write their charts and an HTML report. The
stack stops also on Ctrl-C or an error. The folders stay for `llm-ring report DIR [DIR ...]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from extproc.cli_input import at_least, new_folder, parse_seeds
from extproc.stack import models

STEPS = 5
BUSY_PROFILE, BUSY_REPLICAS = "busy", 3  # the profile is sized for 3 replicas (4 conversations each)
VERDICT_METRICS = ("hit_rate", "redirects", "latency_p50", "latency_p95")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=models.DEFAULT_MODEL, help=f"{' | '.join(models.MODELS)}")
    parser.add_argument("--replicas", type=at_least(1), default=2)
    parser.add_argument("--profile", default="quick", help="traffic profile (name or JSON path)")
    parser.add_argument("--policies", nargs="+", default=["bounded", "llm-aware"], metavar="POLICY")
    parser.add_argument("--seeds", nargs="+", default=["1"], metavar="SEED", help="live seeds (default 1)")
    parser.add_argument("--sim-seeds", nargs="+", default=["1-20"], metavar="SEED",
                        help="simulated seeds (default 1-20)")
    parser.add_argument("--out-dir", type=Path, help="new folder for the demo (default <data dir>/demo/<time>)")
    parser.add_argument("--data-dir", help=f"models etc. (${models.DATA_ENV}, default ~/.local/share/llm-ring)")


def main(args: argparse.Namespace) -> int:
    from extproc.analysis.report import build_report, combine, render_table
    from extproc.experiments.lab import LabError
    from extproc.experiments.run import run_experiment
    from extproc.policy_spec import ExperimentError, parse_policy
    from extproc.stack.commands import FAILURES
    from extproc.stack.lab import LocalLab
    from extproc.stack.settings import load_stack_settings
    from extproc.traffic import ProfileError, load_profile

    began = time.monotonic()
    data = models.data_dir(args.data_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    out = new_folder(args.out_dir or data / "demo" / stamp)
    seeds, sim_seeds = parse_seeds(args.seeds), parse_seeds(args.sim_seeds, "--sim-seeds")
    for policy in args.policies:
        parse_policy(policy)
    live = out / "live"
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
        with LocalLab.start(settings, data, out / "stack", _say) as lab:
            _step(3, f"live: {' vs '.join(args.policies)} on profile {profile.name}, seeds {seeds} "
                     f"via {lab.gateway_url}")
            run_experiment(lab, profile, args.policies, seeds, live, progress=_say)
    except (*FAILURES, ProfileError, ExperimentError, LabError) as exc:
        print(f"llm-ring demo: {exc}", file=sys.stderr)
        return 1
    cores = os.cpu_count() or 1
    _step(4, f"simulated: the same conversations over {len(sim_seeds)} seeds ({args.replicas} replicas sharing "
             f"{cores} cores), and profile {BUSY_PROFILE} on {BUSY_REPLICAS} replicas")
    same, busy = out / "sim", out / f"sim-{BUSY_PROFILE}"  # the live conversations; the busy profile
    named = json.loads((live / "experiment.json").read_text())["model"]  # keyed as the live requests were
    paired_same = simulate(str(live / "profile.json"), args.policies, sim_seeds, args.replicas, cores, same, named)
    paired_busy = simulate(BUSY_PROFILE, args.policies, sim_seeds, BUSY_REPLICAS, cores, busy)
    _step(5, "report")
    live_report = build_report(live)
    both = combine([live, same], [live_report, build_report(same)])
    print(render_table(both), end="")
    print()
    print(verdict(f"{profile.name}, simulated ({len(sim_seeds)} seeds)", paired_same))
    print(verdict(f"{BUSY_PROFILE}, simulated ({len(sim_seeds)} seeds, {BUSY_REPLICAS} replicas)", paired_busy))
    followups = min(run["followups"] for run in live_report["runs"])
    print(f"live ({len(seeds)} seed{'s' if len(seeds) > 1 else ''}): a smoke test of the whole system, not a "
          f"verdict: with {followups} follow-ups a run, one miss moves its hit rate by {100 / max(followups, 1):.1f} "
          f"points.")
    print(prediction_line(live_report["runs"]))
    charts, page = pictures(live, same, both, out)
    print(f"\ncharts (PNG, SVG): {charts}\nHTML report (tables and charts, opens offline): {page}")
    print(f"demo done in {time.monotonic() - began:.0f}s; again: llm-ring report {live} {same}; "
          f"llm-ring report {busy}")
    return 0


def pictures(live: Path, same: Path, both: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """The live and simulated folders' charts into ``out/charts`` and their HTML report into
    ``out/report.html``, as `llm-ring report` writes them."""
    from extproc.analysis.report import report_command, write_pictures

    charts, page = out / "charts", out / "report.html"
    write_pictures([live, same], both, charts, page, report_command([live, same], charts, page))
    return charts, page


def simulate(profile: str, policies: list[str], seeds: list[int], replicas: int, host_cores: int,
             out: Path, model: str = "") -> dict[str, dict[str, dict[str, Any]]]:
    """One simulated experiment folder like the stack's (shared cores), its requests naming
    ``model`` as the live ones did; its paired differences."""
    from extproc.analysis.metrics import paired_differences
    from extproc.analysis.report import SUMMARY_FILE, build_report, render_markdown
    from extproc.sim.costmodel import load_cost_model
    from extproc.sim.runs import load_sim_config, profile_source, run_experiment

    config = load_sim_config()
    cost = load_cost_model(config.cost_model)
    fleet = config.fleet(replicas, cost, host_cores=float(host_cores))
    run_experiment(profile_source(profile), policies, seeds, config, fleet, out, model=model)
    report = build_report(out)
    (out / SUMMARY_FILE).write_text(render_markdown(report, with_runs=True))
    return paired_differences(report["runs"], policies)


def prediction_line(runs: list[dict[str, Any]]) -> str:
    """Per policy, the live requests whose predicted cached tokens were within 10 % of the prompt
    of the replica's cache_n: whether the router counts tokens as the replica does."""
    counts: dict[str, list[int]] = {}
    for run in runs:
        within, predictions = counts.setdefault(run["policy"], [0, 0])
        counts[run["policy"]] = [within + (run["predictions_within_10"] or 0), predictions + (run["predictions"] or 0)]
    shares = ", ".join(f"{policy} {100 * within / predictions:.1f} % ({within}/{predictions})" if predictions
                       else f"{policy} -" for policy, (within, predictions) in counts.items())
    return f"live predictions within 10 % of the prompt (|predicted - cache_n|): {shares}"


def verdict(label: str, paired: dict[str, dict[str, dict[str, Any]]]) -> str:
    """One sentence per comparison: each main metric's paired difference, or "within noise"
    when its 95 % interval includes 0."""
    from extproc.analysis.metrics import METRICS, format_cell

    metrics = {metric.name: metric for metric in METRICS}
    sentences = []
    for comparison, stats in paired.items():
        clauses = []
        for name in VERDICT_METRICS:
            s = stats[name]
            if s["mean"] is None:
                continue
            what = metrics[name].label.lower().replace(" away from the cache per run", " per run")
            if s["ci95"] is None or abs(s["mean"]) <= s["ci95"]:
                clauses.append(f"{what} within noise ({format_cell(metrics[name], s)}, the interval includes 0)")
            else:
                clauses.append(f"{what} {'higher' if s['mean'] > 0 else 'lower'} "
                               f"({format_cell(metrics[name], s)})")
        sentences.append(f"{label}, {comparison} paired by seed: " + "; ".join(clauses) + ".")
    return "\n".join(sentences)


def _step(number: int, text: str) -> None:
    _say(f"[demo {number}/{STEPS}] {text}")


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
