"""Trace replay for the arena: plain traces, arrival jitter, the infinite-cache ceiling, the table."""

from __future__ import annotations

import json

import pytest

from extproc.cli import main
from extproc.sim.mooncake import TraceError, TraceRequest, cacheable_ceiling, jittered_arrivals, read_trace
from extproc.sim.workload import requests_from_trace
from tests.sim.test_mooncake import write


def test_ceiling_on_a_hand_written_trace(tmp_path):
    path = write(tmp_path, [
        {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},  # 512 + 512 + 76
        {"timestamp": 10, "input_length": 600, "output_length": 5, "hash_ids": [1, 9]},     # 1 seen: 512
        {"timestamp": 20, "input_length": 1600, "output_length": 5, "hash_ids": [1, 2, 4, 5]},  # 1, 2 seen: 1024
        {"timestamp": 30, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]},  # all seen: 1100
    ])
    # hits 512 + 1024 + 1100 = 2636 of 1100 + 600 + 1600 + 1100 = 4400 prompt tokens
    assert cacheable_ceiling(read_trace(path)) == pytest.approx(2636 / 4400)


def test_plain_csv_in_azure_columns_and_plain_jsonl(tmp_path):
    csv_path = tmp_path / "azure.csv"
    csv_path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n")
    trace = read_trace(csv_path)
    assert [(round(r.timestamp_s, 3), r.input_length, r.output_length, r.hash_ids) for r in trace] == [
        (0.0, 374, 44, ()), (4.315, 396, 109, ())]
    assert cacheable_ceiling(trace) is None
    jsonl = write(tmp_path, [{"timestamp": 1500, "input_length": 10, "output_length": 2}])
    assert read_trace(jsonl)[0].timestamp_s == 1.5
    bad = tmp_path / "bad.csv"
    bad.write_text("timestamp,input_length,output_length\n0,ten,1\n")
    with pytest.raises(TraceError, match=r"bad.csv:2: input_length: must be an integer"):
        read_trace(bad)


def test_only_arrivals_sharing_a_bucket_are_jittered_and_the_seed_decides():
    trace = [TraceRequest(t, 10, 1, (i,)) for i, t in enumerate((0.0, 0.0, 0.0005, 0.0042, 1.0))]
    one, again, other = (jittered_arrivals(trace, 0.001, seed) for seed in (1, 1, 2))
    assert one == again and one != other
    assert one[3:] == [0.0042, 1.0]  # alone in their millisecond: unchanged
    assert all(0.0 <= at < 0.001 for at in one[:3]) and len(set(one[:3])) == 3
    # milliseconds read as seconds are not exact: 232.922 and 232.921 stay in their own buckets
    close = [TraceRequest(t / 1000, 10, 1, (i,)) for i, t in enumerate((232921, 232922, 232922))]
    spread_out = jittered_arrivals(close, 0.001, 3)
    assert spread_out[0] == 232.921 and all(232.922 <= at < 232.923 for at in spread_out[1:])


def test_trace_table_prints_the_ceiling_and_says_when_hits_are_unknown(tmp_path, capsys):
    trace = write(tmp_path, [{"timestamp": 100 * i, "input_length": 700, "output_length": 4,
                              "hash_ids": [i % 3, 10 + i]} for i in range(12)])
    assert main(["sim", "--trace", str(trace), "--policies", "consistent", "llm-aware", "--seeds", "1-2",
                 "--cost-model", "llama31-8b-h100-vllm", "--replicas", "2", "--out-dir", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    # blocks 0, 1, 2 repeat from the 4th request on: 9 x 512 of 12 x 700 prompt tokens
    assert f"{100 * 9 * 512 / (12 * 700):.1f}%" in out
    assert "Cached share of prompt tokens" in out and "decisions 'home' per run" in out
    assert "cached share of prompt tokens on 'home'" in out
    meta = json.loads((tmp_path / "a" / "sim-trace-r2-consistent-s1" / "run.json").read_text())
    assert meta["extra"]["server"]["kv_cache"] == "paged"  # what the replicas were
    plain = tmp_path / "plain.csv"
    plain.write_text("timestamp,input_length,output_length\n" + "".join(f"{i * 50},300,3\n" for i in range(6)))
    assert main(["sim", "--trace", str(plain), "--policies", "bounded", "--seeds", "1", "--json",
                 "--cost-model", "llama31-8b-h100-vllm", "--out-dir", str(tmp_path / "b")]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["arena"]["ceiling"] is None
    assert "cached_share" not in result["arena"]["replicas"]["3"]["bounded"]
    assert main(["sim", "--trace", str(plain), "--policies", "bounded", "--seeds", "1",
                 "--out-dir", str(tmp_path / "c")]) == 0
    assert "n/a: trace has no block hashes" in capsys.readouterr().out


def test_llama_cpp_options_are_refused_for_a_paged_model(tmp_path, capsys):
    trace = write(tmp_path, [{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}])
    assert main(["sim", "--trace", str(trace), "--policies", "bounded", "--seeds", "1", "--slots", "8",
                 "--cost-model", "llama31-8b-h100-vllm", "--out-dir", str(tmp_path / "o")]) == 2
    assert "--slots: does not apply to the paged cost model llama31-8b-h100-vllm" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_the_router_sees_the_full_blocks_of_a_trace_request(tmp_path):
    path = write(tmp_path, [{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [4, 5, 6]},
                            {"timestamp": 1, "input_length": 1024, "output_length": 5, "hash_ids": [4, 7]}])
    first, second = requests_from_trace(read_trace(path)).requests
    assert first.route.prefix_blocks == (4, 5)  # the 76-token tail block is not a fixed-size block
    assert second.route.prefix_blocks == (4, 7)
