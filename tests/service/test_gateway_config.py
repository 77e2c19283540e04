"""The rendered Envoy configuration is accepted by the real Envoy binary, and says what we mean."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from extproc.envoy.contract import (
    CLUSTER,
    DESTINATION,
    STREAMED_CLUSTER,
    DnsEndpoints,
    EndpointsFile,
    ext_proc_address,
    split_host_port,
    write_endpoints_file,
)
from extproc.envoy.cors import REPLICA_CORS_HEADERS
from extproc.envoy.surface import GENERATION_PATHS, HEALTH_PATHS, MODEL_PREFIX, MODELS_PATHS
from extproc.routing import POLICIES
from extproc.routing.policies.plugin import param_names
from extproc.routing.replica_facts import ReplicaFacts
from extproc.service.dataplanes.own_envoy_config import FlowOptions, flow_options, render_envoy_config
from extproc.service.dataplanes.own_envoy_routes import PREFLIGHT_CLUSTER
from extproc.service.sessions import SessionSources
from extproc.settings import DiscoverySettings, Settings, load_settings
from extproc.stack.processes import ROUTER_REFERENCE, envoy_binary


def render(tmp_path: Path, **overrides: object) -> str:
    arguments: dict = {
        "listen": "127.0.0.1:19000",
        "admin": "127.0.0.1:19001",
        "ext_proc": "@llm-ring-ext-proc",
        "endpoints": EndpointsFile(str(tmp_path / "replicas.json")),
        "fail_open": True,
        "max_request_bytes": 1 << 20,
        "retries": 2,
        "replica_key_file": str(tmp_path / "replica-api-key"),
    }
    return render_envoy_config(**(arguments | overrides))


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"fail_open": False},
        {"ext_proc": None},
        {"endpoints": DnsEndpoints("llm.llm-ring.svc.cluster.local:8080"), "listen": "0.0.0.0:8080"},
        {"cors_origins": ["https://chat.example.com", "*"]},
        {"replica_key_file": None},
        {"flow": FlowOptions(20.0)},
    ],
    ids=["local", "fail-closed", "envoy-alone", "dns-replicas", "cors", "no-replica-key", "flow-control"],
)
@pytest.mark.live
def test_envoy_validates_the_rendered_config(tmp_path: Path, overrides: dict) -> None:
    write_endpoints_file(tmp_path / "replicas.json", {"llm-0": "127.0.0.1:8081"})
    (tmp_path / "replica-api-key").write_text("the-key\n")
    path = tmp_path / "envoy.yaml"
    path.write_text(render(tmp_path, **overrides))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_client_routing_headers_are_stripped_before_ext_proc(tmp_path: Path) -> None:
    config = json.loads(render(tmp_path))
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    names = [f["name"] for f in manager["http_filters"]]
    assert names == [
        "strip-client-routing-headers",
        "whole-body",
        "ext_proc.route",
        "ext_proc.observe",
        "timings",
        "inject-replica-key",
        "envoy.filters.http.router",
    ]
    removed = [m["remove"] for m in manager["http_filters"][0]["typed_config"]["mutations"]["request_mutations"]]
    assert {DESTINATION, "authorization", "x-api-key"} <= set(removed)
    # the session headers reach the service: kept, and sent with the whole header map
    sessions = SessionSources.parse(load_settings(ROUTER_REFERENCE).service.session_ids)
    assert sessions.headers and not set(sessions.headers) & set(removed)
    whole_body, route, observe = (f["typed_config"] for f in manager["http_filters"][1:4])
    assert whole_body["max_request_bytes"] == 1 << 20  # one chunk for ext_proc, 413 past the limit
    assert route["failure_mode_allow"] is True and route["processing_mode"]["request_body_mode"] == "STREAMED"
    assert route["send_body_without_waiting_for_header_response"] is True  # one round trip
    assert route["processing_mode"]["request_header_mode"] == "SEND" and "forward_rules" not in route
    assert observe["observability_mode"] is True and observe["processing_mode"]["response_body_mode"] == "STREAMED"
    assert not json.loads(render(tmp_path, fail_open=False))["static_resources"]["listeners"][0]["filter_chains"][0][
        "filters"
    ][0]["typed_config"]["http_filters"][2]["typed_config"]["failure_mode_allow"]


@pytest.mark.parametrize("fallbacks", [0, 5])
def test_every_replica_route_retries_service_fallbacks_times(tmp_path: Path, fallbacks: int) -> None:
    assert _num_retries(json.loads(render(tmp_path, retries=fallbacks))) == {fallbacks}


def test_the_bench_and_test_gateway_retry_service_fallbacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """start_gateway_envoy renders what the service behind it uses: service.fallbacks of the
    reference settings unless told otherwise."""
    import extproc.stack.processes as processes

    rendered: list[dict] = []

    def start_envoy(config: str, *_: object, **__: object) -> SimpleNamespace:
        rendered.append(json.loads(config))
        return SimpleNamespace()

    monkeypatch.setattr(processes, "start_envoy", start_envoy)
    processes.start_gateway_envoy(tmp_path, None, tmp_path / "replicas.json", fail_open=True)
    processes.start_gateway_envoy(tmp_path, None, tmp_path / "replicas.json", fail_open=True, fallbacks=7)
    reference = load_settings(processes.ROUTER_REFERENCE).service.fallbacks
    assert [_num_retries(config) for config in rendered] == [{reference}, {7}]


def test_the_replicas_key_is_a_file_envoy_reads_and_only_routes_to_the_replicas_send_it(tmp_path: Path) -> None:
    """The key is never in the config, only its file's path; the injector is off but where a
    route turns it on, and only the routes to the replicas do: every generation route, and the
    read-only ones (the service answers those, unless Envoy fails open); no CORS preflight route."""
    text = render(tmp_path, cors_origins=["https://chat.example.com"])
    config = json.loads(text)
    assert config["static_resources"]["secrets"] == [
        {"name": "replica-api-key", "generic_secret": {"secret": {"filename": str(tmp_path / "replica-api-key")}}}]
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (injector,) = [f for f in manager["http_filters"] if f["name"] == "inject-replica-key"]
    assert injector["disabled"] is True and injector["typed_config"]["overwrite"] is True
    generic = injector["typed_config"]["credential"]["typed_config"]
    assert (generic["header"], generic["header_value_prefix"]) == ("authorization", "Bearer ")
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    keyed = [r for r in routes if "inject-replica-key" in r.get("typed_per_filter_config", {})]
    assert keyed == [r for r in routes if r.get("route", {}).get("cluster") in (CLUSTER, STREAMED_CLUSTER)]
    regexes = [r["match"]["safe_regex"]["regex"] for r in keyed if "safe_regex" in r["match"]]
    assert all(any(re.fullmatch(regex, path) for regex in regexes) for path in GENERATION_PATHS)
    others = {r["match"].get("path") or r["match"]["prefix"] for r in keyed if "safe_regex" not in r["match"]}
    assert others == {*MODELS_PATHS, *HEALTH_PATHS, MODEL_PREFIX}
    assert [r for r in routes if r.get("route", {}).get("cluster") == PREFLIGHT_CLUSTER]
    without = json.loads(render(tmp_path, replica_key_file=None))
    assert "secrets" not in without["static_resources"] and "inject-replica-key" not in json.dumps(without)


def _num_retries(config: dict) -> set[int]:
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    return {r["route"]["retry_policy"]["num_retries"] for r in routes if "route" in r}


def test_endpoints_file_is_replaced_atomically(tmp_path: Path) -> None:
    path = tmp_path / "replicas.json"
    write_endpoints_file(path, {"llm-1": "127.0.0.1:2", "llm-0": "127.0.0.1:1"})
    document = json.loads(path.read_text())
    endpoints = document["resources"][0]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [1, 2]
    assert [p.name for p in tmp_path.iterdir()] == ["replicas.json"]  # no temporary left behind
    assert path.stat().st_mode & 0o777 == 0o644  # Envoy may run as another user (Kubernetes)


def test_split_host_port() -> None:
    assert split_host_port("127.0.0.1:80") == ("127.0.0.1", 80)
    assert split_host_port("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError, match="host:port"):
        split_host_port("nowhere")


def test_the_example_in_envoy_dir_is_the_current_rendering() -> None:
    from extproc.service.dataplanes.own_envoy_config import example

    committed = Path(__file__).parents[2] / "envoy" / "envoy.example.yaml"
    assert committed.read_text() == example(), (
        "regenerate: python -m extproc.service.dataplanes.own_envoy_config")


def test_admin_stubs_match_the_proto(tmp_path: Path) -> None:
    from extproc.service.admin_proto import generate

    assert generate(tmp_path) == 0
    here = Path(__file__).parents[2] / "extproc" / "service"
    for name in ("admin_pb2.py", "admin_pb2_grpc.py", "admin_pb2.pyi"):
        generated = (tmp_path / "extproc" / "service" / name).read_text()
        assert (here / name).read_text() == generated, f"regenerate: python -m extproc.service.admin_proto ({name})"


def test_envoy_reaches_the_service_on_its_abstract_socket_alone(tmp_path: Path) -> None:
    """ext_proc and the access log share the socket's cluster: the picker port (host:port)
    serves no access log, so Envoy is never pointed there."""
    config = json.loads(render(tmp_path, ext_proc=ext_proc_address("llm-ring-x")))
    (cluster,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "ext_proc"]
    assert cluster["type"] == "STATIC"
    assert cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"] == {
        "pipe": {"path": "@llm-ring-x"}
    }
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (access_log,) = hcm["access_log"]
    assert access_log["typed_config"]["common_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == "ext_proc"
    with pytest.raises(ValueError, match="service.ext_proc_socket"):
        render(tmp_path, ext_proc="127.0.0.1:9002")
    with pytest.raises(ValueError, match="service.ext_proc_socket is empty"):
        ext_proc_address("")


def test_every_router_setting_is_documented() -> None:
    """Each key has its row in a table of docs/configuration.md (`service.listen`, or `hash_seed` in
    the routing table, `llm-aware.ttft_margin` in the policies' one, `replicas.slots` in the
    replicas' one, `discovery.file.path` for a discovery source's own)."""
    readme = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for policy in POLICIES:
        for key in param_names(policy):
            assert f"| `{policy}.{key}` |" in readme, f"routing.{policy}.{key} has no row in docs/configuration.md"
    for source, model in DiscoverySettings.named_sections().items():
        for key in model.model_fields:
            assert f"| `discovery.{source}.{key}` |" in readme, f"discovery.{source}.{key} has no row"
    for key in ReplicaFacts.model_fields:
        assert f"| `replicas.{key}` |" in readme, f"routing.replicas.{key} has no row"
    for section, field in Settings.model_fields.items():
        for key in field.annotation.model_fields:  # type: ignore[union-attr]
            if (section, key) in (("routing", "params"), ("routing", "replicas"), ("discovery", "sections")):
                continue  # the sections above
            documented = f"| `{section}.{key}` |" in readme or f"| `{key}` |" in readme
            assert documented, f"{section}.{key} has no row in docs/configuration.md"


def test_envoy_is_hardened_for_clients_that_hold_connections(tmp_path: Path) -> None:
    """Finding 5 and 7 of the hostile-client probe: each setting present, with a value that
    does what its comment in envoy.py says."""
    config = json.loads(render(tmp_path))
    (monitor,) = config["overload_manager"]["resource_monitors"]
    assert monitor["typed_config"]["max_active_downstream_connections"] > 0
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    seconds = lambda value: float(value.rstrip("s"))  # noqa: E731
    assert 0 < seconds(hcm["request_headers_timeout"]) <= seconds(hcm["request_timeout"])
    assert 0 < seconds(hcm["common_http_protocol_options"]["idle_timeout"]) < 3600  # Envoy's default: 1 h
    replicas = next(c for c in config["static_resources"]["clusters"] if c["name"] == "replicas")
    options = replicas["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    llama_cpp_keep_alive_s = 5  # cpp-httplib's CPPHTTPLIB_KEEPALIVE_TIMEOUT_SECOND
    assert seconds(options["common_http_protocol_options"]["idle_timeout"]) < llama_cpp_keep_alive_s
    routes = hcm["route_config"]["virtual_hosts"][0]["routes"]
    retry_on = routes[1]["route"]["retry_policy"]["retry_on"].split(",")
    assert "reset" in retry_on and "5xx" not in retry_on  # never after a started answer
    assert routes[0]["match"] == {"connect_matcher": {}} and routes[0]["direct_response"]["status"] == 405
    local_replies = [r for r in routes if "direct_response" in r]
    assert all(r["typed_per_filter_config"]["whole-body"]["disabled"] for r in local_replies)


def test_flow_control_sends_its_headers_and_lets_a_waiting_request_wait_up_to_the_ttl(tmp_path: Path) -> None:
    """Off: the filter as ever. On: the tenant and objective headers as attributes, and Envoy lets
    the service ask for the TTL and a margin (a hung service still fails open after 2 s), also in
    the request's own timeout."""
    def manager(text: str) -> dict:
        return json.loads(text)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]

    def route_filter(text: str) -> dict:
        (found,) = [f for f in manager(text)["http_filters"] if f["name"] == "ext_proc.route"]
        return found["typed_config"]

    reference = load_settings(Path(__file__).parents[2] / "extproc" / "service" / "router.toml")
    assert flow_options(reference.flow) is None  # off in router.toml
    off = route_filter(render(tmp_path))
    assert "max_message_timeout" not in off and not any("inference" in a for a in off["request_attributes"])
    on_text = render(tmp_path, flow=flow_options(reference.flow.model_copy(update={"enabled": True})))
    on = route_filter(on_text)
    # the upload keeps its 30 s; the wait in the queue comes on top
    assert (manager(render(tmp_path))["request_timeout"], manager(on_text)["request_timeout"]) == ("30s", "92s")
    # the flow headers come in the header map: no attribute more for Envoy to evaluate per request
    assert on["request_attributes"] == off["request_attributes"]
    assert (on["message_timeout"], on["max_message_timeout"]) == ("2s", "62s")
    # a wait longer than the idle timeout (300 s) is no idle stream either
    long_wait = flow_options(reference.flow.model_copy(update={"enabled": True, "ttl_seconds": 450.0}))
    assert manager(render(tmp_path, flow=long_wait))["stream_idle_timeout"] == "452s"
    assert manager(on_text)["stream_idle_timeout"] == "300s"


def test_no_replica_cors_header_passes_and_preflights_are_answered_by_envoy_only_with_cors(tmp_path: Path) -> None:
    """Every route to the replicas removes their CORS headers (llama.cpp echoes any Origin); with
    service.cors_origins, a preflight on a served path has a route of its own, which the CORS
    filter needs to answer it (a direct response has no route entry), to a cluster with no endpoint."""
    for cors in ([], ["https://chat.example.com"]):
        config = json.loads(render(tmp_path, cors_origins=cors))
        manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
        host = manager["route_config"]["virtual_hosts"][0]
        forwarding = [r for r in host["routes"] if r.get("route", {}).get("cluster") in (CLUSTER, STREAMED_CLUSTER)]
        assert all(r["response_headers_to_remove"] == list(REPLICA_CORS_HEADERS) for r in forwarding)
        preflights = [r for r in host["routes"] if r.get("route", {}).get("cluster") == PREFLIGHT_CLUSTER]
        assert len(preflights) == (len(GENERATION_PATHS) + len(MODELS_PATHS) + len(HEALTH_PATHS) + 1 if cors else 0)
        assert all(r["typed_per_filter_config"]["ext_proc.route"]["disabled"] for r in preflights)
        clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
        assert (PREFLIGHT_CLUSTER in clusters) == bool(cors)
        if cors:
            assert clusters[PREFLIGHT_CLUSTER]["load_assignment"]["endpoints"] == []
            policy = host["typed_per_filter_config"]["envoy.filters.http.cors"]
            assert policy["forward_not_matching_preflights"] is False
