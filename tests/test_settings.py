from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from extproc.routing.replica_facts import ReplicaFacts
from extproc.routing.settings import with_knobs
from extproc.settings import SettingsError, load_settings, parse_routing, parse_settings
from tests.routing.conftest import BASE


def test_a_missing_key_is_named() -> None:
    raw = {k: v for k, v in BASE.items() if k != "hash_seed"}
    with pytest.raises(SettingsError, match=r"routing settings: routing\.hash_seed: missing"):
        parse_routing(raw)
    raw = {**BASE, "llm-aware": {k: v for k, v in BASE["llm-aware"].items() if k != "ttft_margin"}}
    with pytest.raises(SettingsError, match=r"routing settings: routing\.llm-aware\.ttft_margin: missing"):
        parse_routing(raw)


def test_the_chosen_policy_needs_its_section_and_every_section_given_is_checked() -> None:
    without = {k: v for k, v in BASE.items() if k != "bounded"}
    assert "bounded" not in parse_routing(without).params  # llm-aware is chosen: bounded's is not needed
    with pytest.raises(SettingsError, match=r"bounded\.epsilon: missing.*bounded\.load_unit: missing"):
        parse_routing({**without, "policy": "bounded"})
    with pytest.raises(SettingsError, match=r"kv-cost\.blocks_per_replica: Input should be greater than 0"):
        parse_routing({**BASE, "kv-cost": {**BASE["kv-cost"], "blocks_per_replica": 0}})


@pytest.mark.parametrize(
    ("knob", "value", "key", "complaint"),
    [
        ("epsilon", 0, "llm-aware.epsilon", "greater than 0"),
        ("epsilon", -1.0, "llm-aware.epsilon", "greater than 0"),
        ("virtual_nodes", 0, "virtual_nodes", "greater than 0"),
        ("cache_aware", "maybe", "llm-aware.cache_aware", "boolean"),
        ("long_load_factor", 1.0, "llm-aware.long_load_factor", "greater than 1"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(knob: str, value: object, key: str, complaint: str) -> None:
    with pytest.raises(SettingsError) as error:
        parse_routing(with_knobs(BASE, {knob: value}))
    message = str(error.value)
    assert f"routing settings: routing.{key}:" in message and complaint in message


def test_a_bad_policy_or_load_unit_says_what_is_allowed() -> None:
    with pytest.raises(SettingsError, match=r"unknown policy 'random' \(registered: round-robin, mod-n"):
        parse_routing({**BASE, "policy": "random"})
    with pytest.raises(SettingsError, match=r"bounded\.load_unit: Input should be 'requests' or 'tokens'"):
        parse_routing(with_knobs(BASE, {"policy": "bounded", "load_unit": "bytes"}))


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(SettingsError, match="virtual_nodez: unknown setting"):
        parse_routing({**BASE, "virtual_nodez": 2})
    with pytest.raises(SettingsError, match=r"bounded\.epsilonn: unknown setting"):
        parse_routing(with_knobs(BASE, {"policy": "bounded", "epsilonn": 0.2}))


def test_environment_overrides_the_file(tmp_path: Path) -> None:
    reference = Path(__file__).parents[1] / "extproc" / "service" / "router.toml"
    settings = load_settings(reference, environ={"LLM_RING__ROUTING__BOUNDED__EPSILON": "0.5",
                                                 "LLM_RING__ROUTING__POLICY": '"bounded"'})
    assert settings.routing.params["bounded"].epsilon == 0.5 and settings.routing.policy == "bounded"
    with pytest.raises(SettingsError, match=r"LLM_RING__ROUTING__LLM_AWARE__TTFT_MARGIN \(environment\): "
                                            r"routing\.llm-aware\.ttft_margin: Input should be less than"):
        load_settings(reference, environ={"LLM_RING__ROUTING__LLM_AWARE__TTFT_MARGIN": "11"})


def test_missing_file_and_bad_toml_are_clear(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="not found"):
        load_settings(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[routing\n")
    with pytest.raises(SettingsError, match=re.escape(str(bad)) + ": not valid TOML"):
        load_settings(bad)


def test_every_policy_in_the_registry_has_a_section_in_each_settings_file() -> None:
    """router.toml, sim.toml and both ConfigMaps hold every registered policy's keys (a switch at
    run time, or a spec, finds them)."""
    import yaml

    from extproc.routing import POLICIES
    from extproc.routing.policies.plugin import param_names

    root = Path(__file__).parents[1]
    files = {name: tomllib.loads((root / name).read_text()) for name in ("extproc/service/router.toml",
                                                                       "extproc/sim/sim.toml")}
    for name in ("k8s/41-router-config.yaml", "k8s/inference-pool/20-picker-config.yaml"):
        files[name] = tomllib.loads(yaml.safe_load((root / name).read_text())["data"]["router.toml"])
    for name, raw in files.items():
        for policy in POLICIES:
            assert tuple(raw["routing"].get(policy, {})) == param_names(policy), f"{name}: [routing.{policy}]"


@pytest.mark.parametrize(
    ("url", "complaint"),
    [
        ("http://127.0.0.1:6379", "should match pattern"),
        ("redis://127.0.0.1:port/0", "Port could not be cast"),
        ("redis://127.0.0.1:70000/0", "out of range"),
        ("redis://", "names a host"),
        ("unix://", "names the socket's path"),
    ],
)
def test_a_store_url_the_client_could_not_use_is_refused_by_key(url: str, complaint: str) -> None:
    raw = tomllib.loads((Path(__file__).parents[1] / "extproc" / "service" / "router.toml").read_text())
    raw["store"]["url"] = url
    with pytest.raises(SettingsError, match=re.escape("store.url: ") + ".*" + re.escape(complaint)):
        parse_settings(raw)
    raw["store"]["url"] = "redis://127.0.0.1:6379/0"
    assert parse_settings(raw).store.url == "redis://127.0.0.1:6379/0"


def with_migration_port(listen: str) -> dict[str, Any]:
    """The reference router.toml with ``listen`` as its migration port and no token file."""
    raw = tomllib.loads((Path(__file__).parents[1] / "extproc" / "service" / "router.toml").read_text())
    raw["service"] |= {"migration_listen": listen, "migration_token_file": ""}
    return raw


@pytest.mark.parametrize("listen", ["127.0.0.1:9004", "127.0.0.2:9004", "[::1]:9004", "localhost:9004"])
def test_a_migration_port_on_loopback_may_go_without_a_token(listen: str) -> None:
    assert parse_settings(with_migration_port(listen)).service.migration_listen == listen


@pytest.mark.parametrize("listen", ["0.0.0.0:9004", "[::]:9004", "10.0.0.7:9004", "router:9004", ":9004"])
def test_a_migration_port_off_loopback_needs_a_token_file(listen: str) -> None:
    raw = with_migration_port(listen)
    with pytest.raises(SettingsError, match=r"service\.migration_token_file: Value error, required"):
        parse_settings(raw)
    raw["service"]["migration_token_file"] = "/run/llm-ring/migration/token"
    assert parse_settings(raw).service.migration_token_file == "/run/llm-ring/migration/token"


def reference_with_flow(**flow: Any) -> dict[str, Any]:
    """The reference router.toml with flow control on and ``flow`` changed."""
    raw = tomllib.loads((Path(__file__).parents[1] / "extproc" / "service" / "router.toml").read_text())
    raw["flow"] |= {"enabled": True, **flow}
    return raw


def test_a_missing_flow_key_stops_start_up_naming_it() -> None:
    raw = reference_with_flow()
    del raw["flow"]["ttl_seconds"]
    with pytest.raises(SettingsError, match=r"settings: flow\.ttl_seconds: missing"):
        parse_settings(raw)
    del raw["flow"]
    with pytest.raises(SettingsError, match=r"settings: flow: missing"):
        parse_settings(raw)


@pytest.mark.parametrize(
    ("changes", "complaint"),
    [
        ({"reserved_slots": 4}, "reserved_slots (4) must be below routing.replicas.slots (4)"),
        ({"tenant_header": "X-Tenant"}, "tenant_header: String should match pattern"),
        ({"ttl_seconds": 601.0}, "flow.ttl_seconds: Input should be less than or equal to 600"),
        ({"objectives": {"fast": "high"}}, "flow.objectives.fast: Input should be a valid integer"),
    ],
)
def test_flow_settings_that_could_not_work_are_refused_by_key(changes: dict[str, Any], complaint: str) -> None:
    with pytest.raises(SettingsError, match=re.escape(complaint)):
        parse_settings(reference_with_flow(**changes))


def test_flow_control_and_shedding_are_not_both_on() -> None:
    raw = reference_with_flow()
    raw["service"]["shed_requests_per_replica"] = 4
    with pytest.raises(SettingsError, match=r"flow: Value error, enabled: service\.shed_requests_per_replica"):
        parse_settings(raw)
    raw["flow"]["enabled"] = False
    assert parse_settings(raw).service.shed_requests_per_replica == 4


# What describes the replicas, not a routing choice: each file holds its own replicas' figures
REPLICA_FACTS = ("replicas",)


def routing_files() -> dict[str, dict[str, Any]]:
    """[routing] of router.toml, sim.toml, both ConfigMaps and the local stack's generated settings."""
    import yaml

    from extproc.stack.router import render_router_settings

    root = Path(__file__).parents[1]
    reference = root / "extproc" / "service" / "router.toml"
    files = {name: tomllib.loads((root / name).read_text()) for name in ("extproc/service/router.toml",
                                                                       "extproc/sim/sim.toml")}
    for name in ("k8s/41-router-config.yaml", "k8s/inference-pool/20-picker-config.yaml"):
        files[name] = tomllib.loads(yaml.safe_load((root / name).read_text())["data"]["router.toml"])
    files["llm-ring up"] = tomllib.loads(render_router_settings(
        reference, policy="llm-aware", admin_listen="127.0.0.1:1", metrics_listen="127.0.0.1:2",
        replicas_file=Path("r.json"), envoy_endpoints_file=Path("e.json"),
        replicas=ReplicaFacts(slots=4, cache_tokens=39685)))
    return {name: raw["routing"] for name, raw in files.items()}


def test_the_routing_defaults_are_one_set_everywhere_but_what_describes_the_replicas() -> None:
    """The best measured configuration ships in the service, the simulator, the local stack and
    every ConfigMap alike (README: the headline tables are measured with it)."""
    files = routing_files()
    choices = {name: {policy: {key: value for key, value in section.items() if key not in REPLICA_FACTS}
                      if isinstance(section, dict) else section
                      for policy, section in routing.items() if policy != "policy" and policy not in REPLICA_FACTS}
               for name, routing in files.items()}
    reference = choices["extproc/service/router.toml"]
    for name, chosen in choices.items():
        assert chosen == reference, name
    assert {routing["policy"] for name, routing in files.items() if "policy" in routing} == {"llm-aware"}
    assert reference["llm-aware"]["prefix_index"] is True


def test_each_file_gives_the_prefix_index_the_capacity_of_its_own_replicas() -> None:
    import json

    import yaml

    root = Path(__file__).parents[1]
    files = routing_files()
    def kv_bytes(model: str) -> int:  # the model's KV cache a token
        return int(json.loads((root / f"extproc/sim/costmodels/{model}.json").read_text())["kv_bytes_per_token"])

    h100 = json.loads((root / "extproc/sim/costmodels/llama31-8b-h100-vllm.json").read_text())["server"]
    stack = tomllib.loads((root / "extproc/stack/stack.toml").read_text())["replicas"]
    k8s = yaml.safe_load((root / "k8s/10-llm-config.yaml").read_text())["data"]
    assert stack["model"] == "smollm2" and k8s["MODEL_FILE"].startswith("qwen2.5-0.5b")
    local = stack["ctx_size"] + stack["cache_ram_mib"] * 2**20 // kv_bytes("smollm2-135m")
    pods = int(k8s["LLAMA_ARG_CTX_SIZE"]) + int(k8s["LLAMA_ARG_CACHE_RAM"]) * 2**20 // kv_bytes("qwen05b-shape")
    assert files["extproc/service/router.toml"]["replicas"]["cache_tokens"] == local
    for name in ("k8s/41-router-config.yaml", "k8s/inference-pool/20-picker-config.yaml"):
        assert files[name]["replicas"]["cache_tokens"] == pods, name
        assert files[name]["replicas"]["slots"] == int(k8s["LLAMA_ARG_N_PARALLEL"]), name
    assert files["extproc/sim/sim.toml"]["replicas"]["cache_tokens"] == h100["kv_capacity_tokens"]


@pytest.mark.parametrize(
    ("sources", "complaint"),
    [
        (["x-session-affinity"], "service.session_ids.0: String should match pattern"),
        (["header:X-Session"], "service.session_ids.0: String should match pattern"),  # Envoy's names are lowercase
        (["body:a.b"], "service.session_ids.0: String should match pattern"),  # a top-level field
        (["header:session_id", "header:session_id"], "service.session_ids: Value error, listed more than once: "
                                                     "header:session_id"),
    ],
)
def test_a_session_source_is_a_header_or_a_body_field_named_once(sources: list[str], complaint: str) -> None:
    raw = tomllib.loads((Path(__file__).parents[1] / "extproc" / "service" / "router.toml").read_text())
    raw["service"]["session_ids"] = sources
    with pytest.raises(SettingsError, match=re.escape(complaint)):
        parse_settings(raw)
    raw["service"]["session_ids"] = []  # none: every conversation keyed by its opening
    assert parse_settings(raw).service.session_ids == []


def test_the_replicas_facts_are_one_section_each_key_named() -> None:
    facts = parse_routing(with_knobs(BASE, {"replicas.slots": 2, "replicas.cache_tokens": 5000})).replicas
    assert facts == ReplicaFacts(slots=2, cache_tokens=5000)
    without = {**BASE, "replicas": {"cache_tokens": 5000}}
    with pytest.raises(SettingsError, match=r"routing settings: routing\.replicas\.slots: missing"):
        parse_routing(without)
    with pytest.raises(SettingsError, match=r"routing\.replicas\.cache_tokens: Input should be greater than 0"):
        parse_routing(with_knobs(BASE, {"replicas.cache_tokens": 0}))
    with pytest.raises(SettingsError, match=r"routing\.replicas\.ctx_size: unknown setting \(valid: slots, "
                                            r"cache_tokens\)"):
        parse_routing(with_knobs(BASE, {"replicas.ctx_size": 4096}))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"replica_slots": 4}, "routing.replica_slots: moved to routing.replicas.slots"),
        ({"llm-aware": {**BASE["llm-aware"], "prefix_capacity_tokens": 4096}},
         "routing.llm-aware.prefix_capacity_tokens: moved to routing.replicas.cache_tokens"),
    ],
)
def test_a_replica_fact_under_its_old_key_is_refused_naming_its_place(old: dict[str, Any], new: str) -> None:
    with pytest.raises(SettingsError) as refused:
        parse_routing({**BASE, **old})
    assert str(refused.value) == f"routing settings: {new}"  # one problem, one line


def test_llm_ring_serve_refuses_an_old_key_with_exit_code_2_naming_its_place(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from extproc.cli import main

    reference = Path(__file__).parents[1] / "extproc" / "service" / "router.toml"
    config = tmp_path / "router.toml"
    wake = "prior_model_wake_ms = 1500.0"
    config.write_text(reference.read_text().replace(wake, f"{wake}\nreplica_slots = 4"))  # where it was
    assert main(["serve", "--config", str(config)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"llm-ring serve: {config}: routing.replica_slots: moved to routing.replicas.slots", line


def test_the_replicas_facts_are_knobs_and_environment_overrides_by_their_dotted_names() -> None:
    reference = Path(__file__).parents[1] / "extproc" / "service" / "router.toml"
    settings = load_settings(reference, environ={"LLM_RING__ROUTING__REPLICAS__SLOTS": "2"}).routing
    assert settings.replicas.slots == 2 and settings.knobs()["replicas.slots"] == 2
    assert parse_routing(with_knobs(settings.table(), settings.knobs())) == settings  # the Admin API's round trip
