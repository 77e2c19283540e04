"""`llm-ring bench (decisions|gateway|hostile|sim|flow) [--json]`: figures and ratios in one run."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "decisions": ("extproc.bench.decisions", "per-decision latency of each policy, memory per conversation"),
    "gateway": ("extproc.bench.gateway", "added latency and throughput: direct vs Envoy vs Envoy + ext_proc"),
    "hostile": ("extproc.bench.hostile", "normal clients' p50 with large bodies; a soak with hostile traffic mixed in"),
    "sim": ("extproc.bench.sim", "simulated requests per second; the Mooncake trace through all policies"),
    "flow": ("extproc.bench.flow", "a noisy neighbour against a running gateway; a replica's batch-step bound"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for name, (module_name, help_text) in BENCHMARKS.items():
        bench = sub.add_parser(name, help=help_text, description=help_text)
        bench.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
        bench.set_defaults(_bench_module=module_name)
        # every benchmark's options (the argv given to extproc.cli.main, not sys.argv, is parsed)
        configure_bench = getattr(importlib.import_module(module_name), "configure", None)
        if configure_bench is not None:
            configure_bench(bench)


def main(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).main(args) or 0)
