"""Random-weight Qwen2 GGUFs: shapes llama.cpp expects, the tokenizer copied byte for byte,
deterministic per seed. Uses a small hand-made vocab GGUF (the real one needs a download)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

from extproc.stack.models import ModelError, kv_bytes_per_token
from extproc.stack.random_gguf import QWEN25_05B, TINY, Qwen2Shape, VocabGGUF, write_random_qwen2

TOKENS = [f"tok{i}" for i in range(96)] + ["\u0120caf\u00e9", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("vocab") / "vocab.gguf"
    writer = GGUFWriter(path, "qwen2")
    writer.add_block_count(32)  # the vocab file's own shapes must not leak into the model
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([1] * (len(TOKENS) - 3) + [3, 3, 3])
    writer.add_token_merges(["t o", "to k"])
    writer.add_eos_token_id(len(TOKENS) - 1)
    writer.add_bos_token_id(len(TOKENS) - 1)
    writer.add_chat_template(TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write(tmp_path: Path, vocab: Path, shape: Qwen2Shape = TINY, weight_type: str = "Q8_0", seed: int = 0) -> Path:
    out = tmp_path / f"model-{weight_type}-{seed}.gguf"
    write_random_qwen2(out, shape, vocab, weight_type, seed, "test")  # type: ignore[arg-type]
    return out


def test_model_has_qwen2_shapes_and_the_vocab_tokenizer(tmp_path: Path, vocab: Path) -> None:
    reader = GGUFReader(write(tmp_path, vocab))
    fields = reader.fields
    assert fields["general.architecture"].contents() == "qwen2"
    assert fields["qwen2.block_count"].contents() == TINY.n_layer
    assert fields["qwen2.attention.head_count_kv"].contents() == TINY.n_head_kv
    assert fields["tokenizer.ggml.tokens"].contents() == TOKENS
    assert fields["tokenizer.ggml.merges"].contents() == ["t o", "to k"]
    assert fields["tokenizer.chat_template"].contents() == TEMPLATE
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 12 * TINY.n_layer  # embedding (tied output), final norm, 12 per layer
    embedding = tensors["token_embd.weight"]
    assert embedding.tensor_type == GGMLQuantizationType.Q8_0
    assert list(embedding.shape) == [TINY.n_embd, len(TOKENS)]
    kv_dim = TINY.n_head_kv * TINY.head_dim
    assert list(tensors["blk.1.attn_k.weight"].shape) == [TINY.n_embd, kv_dim]
    assert list(tensors["blk.1.ffn_down.weight"].shape) == [TINY.n_ff, TINY.n_embd]
    assert tensors["blk.0.attn_norm.weight"].tensor_type == GGMLQuantizationType.F32
    assert np.all(tensors["blk.0.attn_norm.weight"].data == 1.0)


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path: Path, vocab: Path) -> None:
    first = write(tmp_path, vocab, seed=1).read_bytes()
    again = write(tmp_path, vocab, seed=1).read_bytes()
    other = write(tmp_path, vocab, seed=2).read_bytes()
    assert first == again
    assert first != other
    assert len(first) == len(other)


def test_f16_weights_are_finite_with_a_small_spread(tmp_path: Path, vocab: Path) -> None:
    reader = GGUFReader(write(tmp_path, vocab, weight_type="F16"))
    weights = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert weights.tensor_type == GGMLQuantizationType.F16
    values = np.asarray(weights.data, dtype=np.float32)
    assert np.isfinite(values).all()
    assert 0.01 < float(values.std()) < 0.04


def test_q8_0_refuses_dimensions_not_divisible_by_32(tmp_path: Path, vocab: Path) -> None:
    with pytest.raises(ValueError, match="divisible by 32"):
        write(tmp_path, vocab, shape=Qwen2Shape(n_layer=1, n_embd=48, n_head=4, n_head_kv=2, n_ff=96))


def test_a_file_without_tokenizer_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    writer = GGUFWriter(path, "qwen2")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="not a vocab GGUF"):
        VocabGGUF.read(path)


def test_qwen25_shapes_match_the_real_model() -> None:
    assert (QWEN25_05B.n_layer, QWEN25_05B.n_embd, QWEN25_05B.n_head, QWEN25_05B.n_head_kv, QWEN25_05B.n_ff) == (
        24, 896, 14, 2, 4864)
    assert QWEN25_05B.kv_bytes_per_token() == 12 * 1024


def test_a_tokens_kv_bytes_come_from_the_models_shapes(tmp_path: Path, vocab: Path) -> None:
    """`llm-ring up` sizes the prefix index from them (ctx_size + cache-ram / these bytes)."""
    assert kv_bytes_per_token(write(tmp_path, vocab)) == TINY.n_layer * TINY.n_head_kv * 2 * TINY.head_dim * 2
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="notes.gguf: cannot read its GGUF metadata"):
        kv_bytes_per_token(not_gguf)
    nameless = tmp_path / "nameless.gguf"  # a GGUF without the architecture its shapes are keyed by
    writer = GGUFWriter(nameless, "qwen2")
    writer.kv_data[0].pop("general.architecture")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelError, match="nameless.gguf: its GGUF metadata names no general.architecture"):
        kv_bytes_per_token(nameless)
