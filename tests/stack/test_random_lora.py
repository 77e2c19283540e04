"""Random LoRA adapters (extproc/stack/random_lora.py): llama.cpp's adapter format, the base
model's shapes, deterministic; [replicas] lora loads them on every replica, and llama.cpp
(xllamacpp) takes them and answers a request naming them."""

from __future__ import annotations

from pathlib import Path

import httpx
import numpy as np
import pytest
from gguf import GGUFReader

from extproc.stack import models, stack
from extproc.stack.errors import StackError
from extproc.stack.random_lora import DELTA_STD, RANK, adapted, write_random_lora
from extproc.stack.replicas import ReplicaSettings, command
from extproc.stack.settings import load_stack_settings
from tests.service.gateway_support import llama_replicas


@pytest.fixture(scope="module")
def base() -> Path:
    return models.smollm2_gguf()  # 30 layers, llama


def test_an_adapter_pairs_every_attention_weight_of_its_base_in_llama_cpps_format(tmp_path: Path, base: Path) -> None:
    write_random_lora(tmp_path / "a.gguf", base, 1, "a")
    adapter, model = GGUFReader(tmp_path / "a.gguf"), GGUFReader(base)
    fields = {key: adapter.fields[key].contents() for key in ("general.type", "general.architecture", "adapter.type",
                                                             "adapter.lora.alpha")}
    assert fields == {"general.type": "adapter", "general.architecture": "llama", "adapter.type": "lora",
                      "adapter.lora.alpha": float(RANK)}
    shapes = {tensor.name: tuple(int(n) for n in tensor.shape) for tensor in adapter.tensors}
    targets = [tensor for tensor in model.tensors if adapted(tensor.name)]
    assert len(targets) == 4 * 30 and len(shapes) == 2 * len(targets)  # q, k, v, output of every layer
    for tensor in targets:
        columns, rows = (int(n) for n in tensor.shape)
        assert shapes[tensor.name + ".lora_a"] == (columns, RANK) and shapes[tensor.name + ".lora_b"] == (RANK, rows)
    first = {tensor.name: np.array(tensor.data) for tensor in adapter.tensors}
    delta = first["blk.0.attn_q.weight.lora_b"] @ first["blk.0.attn_q.weight.lora_a"]
    assert 0.5 * DELTA_STD < float(delta.std()) < 2 * DELTA_STD


def test_same_seed_same_bytes_other_seed_other_adapter(tmp_path: Path, base: Path) -> None:
    for name, seed in (("one", 1), ("again", 1), ("other", 2)):
        write_random_lora(tmp_path / f"{name}.gguf", base, seed, "a")
    assert (tmp_path / "one.gguf").read_bytes() == (tmp_path / "again.gguf").read_bytes()
    assert (tmp_path / "one.gguf").read_bytes() != (tmp_path / "other.gguf").read_bytes()


def test_the_stack_loads_every_adapter_at_scale_0_and_refuses_one_made_for_another_model(tmp_path: Path) -> None:
    settings = ReplicaSettings("xllamacpp", "/m/tiny.gguf", 2048, 2, 1, 0, lora=("/m/a.gguf", "/m/b.gguf"))
    line = command(settings, 9000, tmp_path, tmp_path / "key")
    assert [line[at + 1] for at, flag in enumerate(line) if flag == "--lora-scaled"] == ["/m/a.gguf:0", "/m/b.gguf:0"]
    assert load_stack_settings(overrides={"replicas": {"lora": ["tiny-lora-a"]}}).replicas.lora == ["tiny-lora-a"]
    with pytest.raises(StackError, match="'tiny-lora-a' is made for 'tiny'.*smollm2"):
        stack._adapter("tiny-lora-a", ("tiny", "smollm2"), tmp_path, lambda _: None)
    with pytest.raises(models.ModelError, match="lora 'tiny'.*neither a known adapter"):
        models.resolve("tiny", tmp_path, adapter=True)
    with pytest.raises(models.ModelError, match="--model 'tiny-lora-a'.*neither a known model"):
        models.resolve("tiny-lora-a", tmp_path)


@pytest.mark.live
def test_llama_cpp_loads_smollm2s_adapters_and_answers_a_request_naming_them(tmp_path: Path) -> None:
    with llama_replicas(tmp_path, count=1, lora=("smollm2-lora-a", "smollm2-lora-b")) as replicas:
        client = httpx.Client(base_url=f"http://{replicas.addresses['llm-0']}", headers=replicas.headers, timeout=60)
        loaded = client.get("/lora-adapters").json()
        assert [(entry["id"], entry["scale"], Path(entry["path"]).name) for entry in loaded] == [
            (0, 0.0, "smollm2-lora-a.gguf"), (1, 0.0, "smollm2-lora-b.gguf")]
        for lora in ([], [{"id": 0, "scale": 1.0}], [{"id": 0, "scale": 0.5}, {"id": 1, "scale": 1.0}]):
            reply = client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
                "max_tokens": 8, "temperature": 0, "lora": lora})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"]
        client.close()
