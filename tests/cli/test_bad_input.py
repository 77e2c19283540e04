"""Bad input on the command line: exit code 2, one line naming the problem and its origin,
no traceback, nothing written. One test per case; the commands run through `llm-ring`'s main()
(and once as the installed entry point in a subprocess)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.service.main import __file__ as SERVICE_MAIN
from extproc.sim.runs import SIM_CONFIG
from extproc.stack.processes import free_port

ROUTER_TOML = Path(SERVICE_MAIN).with_name("router.toml")
SIM = ["sim", "--profile", "quick", "--policies", "bounded"]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_sim_into_an_existing_out_dir_is_refused(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "keep.txt").write_text("an earlier run")
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "--out-dir", str(tmp_path / "old"))
    assert_refused(code, err, "--out-dir", "already exists")
    assert [p.name for p in (tmp_path / "old").iterdir()] == ["keep.txt"]


def test_empty_seed_range_is_refused_and_leaves_no_folder(tmp_path, capsys):
    code, err = run_cli(capsys, *SIM, "--seeds", "3-1", "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "--seeds", "'3-1' is an empty range")
    assert not (tmp_path / "out").exists()


def test_a_seed_given_twice_is_refused(tmp_path, capsys):
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "1-2", "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "--seeds", "seed 1 given twice")
    assert not (tmp_path / "out").exists()


def test_a_fleet_of_zero_replicas_is_refused(tmp_path, capsys):
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "--replicas", "0", "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "--replicas", "must be >= 1 (got 0)")
    assert not (tmp_path / "out").exists()


def test_a_fleet_size_given_twice_is_refused(tmp_path, capsys):
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "--replicas", "2", "2", "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "--replicas", "2 given twice")


def test_negative_host_cores_are_refused(tmp_path, capsys):
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "--host-cores", "-1", "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "--host-cores", "must be >= 0 (got -1)")


def test_an_empty_trace_file_is_refused(tmp_path, capsys):
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n")
    code, err = run_cli(capsys, "sim", "--trace", str(trace), "--policies", "consistent", "--seeds", "1",
                        "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, f"--trace {trace}", "no requests")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", [SIM, ["run", "--profile", "quick", "--policies", "bounded"]])
def test_an_out_dir_that_is_a_file_is_refused(tmp_path, capsys, command):
    afile = tmp_path / "afile"
    afile.write_text("")
    code, err = run_cli(capsys, *command, "--seeds", "1", "--out-dir", str(afile))
    assert_refused(code, err, f"--out-dir {afile}", "already exists (a file)")
    code, err = run_cli(capsys, *command, "--seeds", "1", "--out-dir", str(afile / "under"))
    assert_refused(code, err, f"{afile} is a file, not a folder")


def test_report_on_a_corrupt_parquet_names_the_folder(tmp_path):
    folder = tmp_path / "exp"
    (folder / "bounded-s1").mkdir(parents=True)
    (folder / "bounded-s1" / "requests.parquet").write_bytes(b"not a parquet file at all")
    entry_point = Path(sys.executable).with_name("llm-ring")
    done = subprocess.run([str(entry_point), "report", str(folder)], capture_output=True, text=True, timeout=120)
    assert_refused(done.returncode, done.stderr, f"llm-ring report: {folder}: cannot read the records",
                   "requests.parquet")
    assert sorted(p.name for p in folder.rglob("*")) == ["bounded-s1", "requests.parquet"]  # no summary.md


def test_an_unknown_policy_knob_is_named_with_the_valid_ones(tmp_path, capsys):
    code, err = run_cli(capsys, "sim", "--profile", "quick", "--policies", "bounded:colour=red", "--seeds", "1",
                        "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "policy 'bounded:colour=red': unknown setting colour",
                   "valid: epsilon, load_unit, virtual_nodes",
                   "epsilon")


def test_a_bad_environment_variable_is_blamed_not_the_file(capsys, monkeypatch):
    monkeypatch.setenv("LLM_RING__ROUTING__EPSILON", "-3")
    code, err = run_cli(capsys, "serve", "--config", str(ROUTER_TOML))
    assert_refused(code, err, "LLM_RING__ROUTING__EPSILON (environment): routing.epsilon")
    assert str(ROUTER_TOML) not in err


def test_an_unknown_setting_from_the_environment_is_blamed_on_the_variable(capsys, monkeypatch):
    monkeypatch.setenv("LLM_RING__ROUTING__COLOUR", "red")
    code, err = run_cli(capsys, "serve", "--config", str(ROUTER_TOML))
    assert_refused(code, err, "LLM_RING__ROUTING__COLOUR (environment): routing.colour: unknown setting")


def test_a_typo_in_sim_toml_names_the_file(tmp_path, capsys):
    config = tmp_path / "sim.toml"
    config.write_text(SIM_CONFIG.read_text().replace("\nvirtual_nodes =", "\nvirtual_nodez ="))
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "--config", str(config), "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, f"{config}: routing.virtual_nodez: unknown setting (valid: virtual_nodes, hash_seed,")
    config.write_text(SIM_CONFIG.read_text().replace("\nslots =", "\nslot ="))
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "--config", str(config), "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, f"{config}: replica.slot: unknown setting (valid: slots, cache_ram_mib")


def test_run_refuses_bad_seeds_before_looking_for_a_stack(tmp_path, capsys):
    code, err = run_cli(capsys, "run", "--profile", "quick", "--policies", "bounded", "--seeds", "2", "2",
                        "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "--seeds", "seed 2 given twice")


def test_scaling_to_no_replica_is_refused(tmp_path, capsys):
    code, err = run_cli(capsys, *SIM, "--seeds", "1", "--scale", "10:0", "--out-dir", str(tmp_path / "out"))
    assert_refused(code, err, "--scale: '10:0': a fleet needs at least 1 replica")
    assert not (tmp_path / "out").exists()


def test_bench_gateway_with_the_store_on_and_no_redis_server_is_refused(capsys, monkeypatch):
    monkeypatch.setattr("extproc.bench.gateway.redis_server_binary", lambda: None)
    assert_refused(*run_cli(capsys, "bench", "gateway", "--store", "on", "off"), "--store on needs redis-server")


def test_an_unusable_store_url_stops_the_service_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLM_RING__STORE__URL", '"redis://127.0.0.1:port/0"')
    assert_refused(*run_cli(capsys, "serve", "--config", str(ROUTER_TOML)), "LLM_RING__STORE__URL", "store.url")


def test_an_unreadable_store_password_file_stops_the_service_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLM_RING__STORE__URL", '"redis://llm-ring@127.0.0.1:1/0"')
    monkeypatch.setenv("LLM_RING__STORE__PASSWORD_FILE", f'"{tmp_path / "missing"}"')
    assert_refused(*run_cli(capsys, "serve", "--config", str(ROUTER_TOML)), "store.password_file", "missing")


def test_a_migration_port_off_loopback_without_a_token_file_stops_the_service(capsys, monkeypatch):
    monkeypatch.setenv("LLM_RING__SERVICE__MIGRATION_LISTEN", '"0.0.0.0:9004"')
    assert_refused(*run_cli(capsys, "serve", "--config", str(ROUTER_TOML)), "service.migration_token_file",
                   "required", "not on loopback")


@pytest.mark.parametrize(("token", "problem"), [(None, "cannot read"), ("", "is empty"), ("\n", "is empty")])
def test_a_missing_or_empty_migration_token_file_stops_the_service_naming_the_key(tmp_path, capsys, monkeypatch,
                                                                                 token, problem):
    path = tmp_path / "token"
    if token is not None:
        path.write_text(token)
    monkeypatch.setenv("LLM_RING__SERVICE__MIGRATION_LISTEN", '"0.0.0.0:9004"')
    monkeypatch.setenv("LLM_RING__SERVICE__MIGRATION_TOKEN_FILE", f'"{path}"')
    assert_refused(*run_cli(capsys, "serve", "--config", str(ROUTER_TOML)), "service.migration_token_file",
                   str(path), problem)


@pytest.mark.parametrize(("key", "problem"), [(None, "cannot read"), ("\n", "is empty")])
def test_a_missing_or_empty_replica_key_file_stops_the_service_naming_the_key(tmp_path, capsys, monkeypatch, key,
                                                                              problem):
    path = tmp_path / "key"
    if key is not None:
        path.write_text(key)
    monkeypatch.setenv("LLM_RING__SERVICE__REPLICA_API_KEY_FILE", f'"{path}"')
    assert_refused(*run_cli(capsys, "serve", "--config", str(ROUTER_TOML)), "service.replica_api_key_file",
                   str(path), problem)


def test_calibrate_with_an_unreadable_api_key_file_stops_naming_the_option(tmp_path, capsys):
    assert_refused(*run_cli(capsys, "calibrate", "--url", "http://127.0.0.1:1", "--api-key-file",
                            str(tmp_path / "key"), "--name", "x", "--kv-bytes-per-token", "1",
                            "--out", str(tmp_path / "x.json")), "--api-key-file", "cannot read")


def test_a_missing_tokenizer_file_stops_the_service_naming_the_key(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLM_RING__SERVICE__TOKENIZER", f'"{tmp_path / "model.gguf"}"')
    assert_refused(*run_cli(capsys, "serve", "--config", str(ROUTER_TOML)), "service.tokenizer", "no such file")


def test_a_tokenizer_file_that_is_no_gguf_stops_the_service(tmp_path, capsys, monkeypatch):
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    monkeypatch.setenv("LLM_RING__SERVICE__TOKENIZER", f'"{tmp_path / "tokenizer.json"}"')
    assert_refused(*run_cli(capsys, "serve", "--config", str(ROUTER_TOML)), "service.tokenizer", "not a GGUF file")


def test_bench_flow_without_a_key_file_or_a_gateway_is_refused(capsys, tmp_path):
    assert_refused(*run_cli(capsys, "bench", "flow", "--step-bound", "http://127.0.0.1:9"), "needs --key-file")
    assert_refused(*run_cli(capsys, "bench", "flow", "--step-bound", "http://127.0.0.1:9", "--key-file",
                            str(tmp_path / "missing")), "missing")
    unused = f"http://127.0.0.1:{free_port()}"
    assert_refused(*run_cli(capsys, "bench", "flow", "--url", unused, "--rounds", "1"), unused)
