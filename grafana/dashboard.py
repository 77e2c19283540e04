"""Render the router's Grafana dashboard: grafana/llm-ring-router.json (import it as is) and
k8s/monitoring/grafana-dashboard.yaml (the same JSON in a ConfigMap that Grafana's dashboard
sidecar provisions: label grafana_dashboard=1).

Every panel reads the routing service's own metrics (extproc/service/metrics.py, served on
service.metrics_listen); tests/service/test_dashboard.py runs each query on Debian's
Prometheus scraping a live router and fails when one returns no series. tests/service also
fails when the committed files differ from this rendering.

    .venv/bin/python grafana/dashboard.py            # rewrite both files
    .venv/bin/python grafana/dashboard.py --check    # exit 1 if they are out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "llm-ring-router.json"
CONFIGMAP = HERE.parent / "k8s" / "monitoring" / "grafana-dashboard.yaml"
UID = "llm-ring-router"
NAMESPACE = "llm-ring"
# Grafana's own variables: the routers shown, the rate window, the data source
ROUTERS = 'instance=~"$instance"'
WINDOW = "[$__rate_interval]"


def rate(metric: str, by: str = "") -> str:
    """Per second over the window, summed (by ``by``) over the routers shown."""
    return f"sum{f' by ({by})' if by else ''} (rate({metric}{{{ROUTERS}}}{WINDOW}))"


def share_between(low: str, high: str) -> str:
    """Share of the requests whose prediction error falls in (low, high] tokens."""
    bucket = "llm_ring_cached_tokens_prediction_error_bucket"
    return (f'(sum(rate({bucket}{{{ROUTERS}, le="{high}"}}{WINDOW})) - sum(rate({bucket}{{{ROUTERS}, le="{low}"}}'
            f'{WINDOW}))) / sum(rate({bucket}{{{ROUTERS}, le="+Inf"}}{WINDOW}))')


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    description: str = ""


PANELS = (
    Panel("Routing decisions by reason", "reqps",
          ((rate("llm_ring_decisions_total", "policy, reason"), "{{policy}}: {{reason}}"),),
          "Why the router chose each replica (docs/policies.md, reason codes)."),
    Panel("Cached share of prompt tokens: predicted vs reported", "percentunit",
          ((f'{rate("llm_ring_predicted_cached_tokens_total")} / {rate("llm_ring_actual_prompt_tokens_total")}',
            "predicted by the router"),
           (f'{rate("llm_ring_actual_cached_tokens_total")} / {rate("llm_ring_actual_prompt_tokens_total")}',
            "reported by the replicas (cache_n)")),
          "Requests whose answers carried timings. The follow-up hit rate of the reports, as the fleet sees it."),
    Panel("Cached tokens predicted within N tokens of the replica's report", "percentunit",
          ((share_between("-16", "16"), "within 16 tokens"), (share_between("-256", "256"), "within 256 tokens")),
          "Share of requests with |cache_n - predicted| within the bound."),
    Panel("Requests in flight per replica", "short",
          ((f"sum by (replica) (llm_ring_in_flight_requests{{{ROUTERS}}})", "{{replica}}"),),
          "Summed over the routers shown (each counts its own requests)."),
    Panel("Tokens in flight per replica", "short",
          ((f"sum by (replica) (llm_ring_in_flight_tokens{{{ROUTERS}}})", "{{replica}}"),)),
    Panel("Learnt prefill speed per replica", "short",
          ((f"avg by (replica) (llm_ring_replica_prefill_tokens_per_second{{{ROUTERS}}})", "{{replica}}"),),
          "Prompt tokens per second, learnt from the answers' timings (docs/policies.md)."),
    Panel("Learnt decode speed per replica", "short",
          ((f"avg by (replica) (llm_ring_replica_decode_tokens_per_second{{{ROUTERS}}})", "{{replica}}"),),
          "Generated tokens per second, learnt from the answers' timings."),
    Panel("Replica health", "short",
          ((f"min by (replica) (llm_ring_replica_healthy{{{ROUTERS}}})", "{{replica}}"),),
          "1 unless a request failed there and /health has not answered since."),
    Panel("Time the router adds per request (body parsed + decision)", "s",
          tuple((f"histogram_quantile({q}, {rate('llm_ring_decision_seconds_bucket', 'le')})", f"p{round(q * 100)}")
                for q in (0.5, 0.95, 0.99))),
    Panel("Requests completed by outcome", "reqps",
          ((rate("llm_ring_requests_completed_total", "outcome"), "{{outcome}}"),
           (rate("llm_ring_released_by_next_turn_total"), "released by the next turn")),
          "failed_over: answered by a fallback; not_applied: Envoy served without the pick."),
    Panel("Requests the gateway answered itself; branched chats", "reqps",
          ((rate("llm_ring_answered_locally_total", "kind"), "answered locally: {{kind}}"),
           (rate("llm_ring_branches_total"), "branches (edited or regenerated chats)")),
          "Read-only requests (models, health, CORS preflight) need no replica; a branch starts where the "
          "history it resends was served."),
    Panel("Requests refused or failed by kind", "reqps",
          ((rate("llm_ring_errors_total", "kind"), "{{kind}}"),),
          "shed: refused while every replica has service.shed_requests_per_replica requests in flight (blind to "
          "tenants; flow control queues instead)."),
    Panel("Flow control: requests by how they left", "reqps",
          ((rate("llm_ring_flow_requests_total", "band, outcome"), "band {{band}}: {{outcome}}"),),
          "at_once: a replica had room; local, new, fair: from the queue (docs/flow-control.md, the order); "
          "expired, queue_full, no_replica: refused; cancelled: the client left while it waited."),
    Panel("Flow control: time waited in the router", "s",
          tuple((f"histogram_quantile({q}, {rate('llm_ring_flow_wait_seconds_bucket', 'le, band')})",
                 f"band {{{{band}}}} p{round(q * 100)}") for q in (0.5, 0.95)),
          "Requests that left the queue for a replica; waiting now, by tenant: llm_ring_flow_waiting."),
    Panel("Flow control: Jain's fairness index", "short",
          ((f"min(llm_ring_flow_jain_index{{{ROUTERS}}})", "least fair router"),),
          "Work served in the last 60 s to the tenants that had to wait: 1 equal shares, 1/n one takes all."),
    Panel("Shared store: in use and failed calls", "short",
          ((f"min(llm_ring_store_in_use{{{ROUTERS}}})", "in use (1 on every router)"),
           (rate("llm_ring_store_errors_total", "call"), "failed {{call}} / s")),
          "0 in use: no store configured, or it fails and decisions run on local state."),
    Panel("Shared store: entries skipped, writes dropped", "short",
          ((rate("llm_ring_store_invalid_entries_total", "entry"), "invalid {{entry}} / s"),
           (rate("llm_ring_store_writes_dropped_total"), "writes dropped / s")),
          "docs/several-gateways.md: the store's trust model."),
    Panel("Stream failures (a bug of ours; Envoy fails open)", "reqps",
          ((rate("llm_ring_stream_failures_total", "stream"), "{{stream}}"),)),
)  # fmt: skip


def queries() -> list[str]:
    return [expr for panel in PANELS for expr, _ in panel.queries]


def render_dashboard() -> dict[str, Any]:
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = [
        {
            "id": number + 1, "type": "timeseries", "title": panel.title, "description": panel.description,
            "datasource": source,
            "gridPos": {"h": 8, "w": 12, "x": 12 * (number % 2), "y": 8 * (number // 2)},
            "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "none"}},
            "targets": [{"refId": chr(ord("A") + i), "datasource": source, "expr": expr, "legendFormat": legend}
                        for i, (expr, legend) in enumerate(panel.queries)],
        }
        for number, panel in enumerate(PANELS)
    ]  # fmt: skip
    instance = {
        "name": "instance", "label": "router", "type": "query", "datasource": source,
        "query": {"query": "label_values(llm_ring_decision_seconds_count, instance)", "refId": "routers"},
        "definition": "label_values(llm_ring_decision_seconds_count, instance)",
        "multi": True, "includeAll": True, "allValue": ".*", "refresh": 2, "sort": 1,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
    }  # fmt: skip
    return {
        "uid": UID, "title": "llm-ring router", "tags": ["llm-ring"], "editable": True, "schemaVersion": 39,
        "version": 1, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "",
        "annotations": {"list": []},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0},
            instance,
        ]},
        "panels": panels,
    }  # fmt: skip


def render_configmap(dashboard: dict[str, Any]) -> str:
    configmap = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "llm-ring-grafana-dashboard", "namespace": NAMESPACE,
                     "labels": {"grafana_dashboard": "1", "app.kubernetes.io/part-of": "llm-ring"}},
        "data": {f"{UID}.json": dashboard_text(dashboard)},
    }  # fmt: skip
    header = ("# GENERATED by grafana/dashboard.py (the same JSON as grafana/llm-ring-router.json): do not edit.\n"
              "# Grafana's dashboard sidecar (kube-prometheus-stack, the grafana chart) loads ConfigMaps labelled\n"
              "# grafana_dashboard=1: kubectl apply -f k8s/monitoring/\n")
    return header + yaml.dump(configmap, Dumper=_BlockDumper, sort_keys=False, width=1000)


class _BlockDumper(yaml.SafeDumper):
    """Multi-line strings as literal blocks: the dashboard reads as JSON inside the ConfigMap."""


def _string(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None)


_BlockDumper.add_representer(str, _string)


def dashboard_text(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2) + "\n"


def rendered() -> dict[Path, str]:
    dashboard = render_dashboard()
    return {DASHBOARD: dashboard_text(dashboard), CONFIGMAP: render_configmap(dashboard)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file is out of date")
    args = parser.parse_args(argv)
    stale = [path for path, text in rendered().items() if not path.exists() or path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path} is out of date: run .venv/bin/python grafana/dashboard.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in rendered().items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
