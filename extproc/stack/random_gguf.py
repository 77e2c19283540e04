"""Random-weight Qwen2 GGUF files with a real tokenizer.

The weights are noise, so the text is junk, but the compute per token equals that of a
real model of the same shapes: what the router experiments measure (prefill, decode, KV
cache reuse) is what a trained model would cost. The tokenizer and chat template come from
a vocab-only GGUF (llama.cpp's models/ggml-vocab-qwen2.gguf), so prompts tokenize exactly
as they would for Qwen2.5.

GGUF is written here directly (header, key/values, tensor infos, aligned data) rather than
through gguf.GGUFWriter: the tokenizer's 450k strings are copied as raw bytes (gguf's
reader and writer take ~40 s for them, this takes 0.2 s), and Q8_0 blocks are made as
random bytes (a constant f16 scale + 32 random int8 per block) instead of quantizing
random floats. The output is a deterministic function of (shape, type, seed, vocab file).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, LlamaFileType

WeightType = Literal["Q8_0", "F16"]
WEIGHT_STD = 0.02  # like a trained model's init: activations stay finite through the layers
Q8_0_BLOCK = 32
Q8_0_BLOCK_BYTES = 2 + Q8_0_BLOCK  # f16 scale + 32 x int8
UNIFORM_INT8_STD = 73.9  # std of a uniform int8 in [-128, 127]
ALIGNMENT = 32  # GGUF's default data alignment
GGUF_VERSION = 3

# The tokenizer keys copied from the vocab GGUF (its other keys describe its own shapes).
TOKENIZER_KEYS = frozenset({
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
})
REQUIRED_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.chat_template")


@dataclass(frozen=True)
class Qwen2Shape:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    n_ff: int
    context_length: int = 32768
    rope_freq_base: float = 1_000_000.0
    rms_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV cache per token (f16 K and V over all layers): 12 KiB for the 0.5B shapes."""
        return 2 * self.n_layer * self.n_head_kv * self.head_dim * bytes_per_value


QWEN25_05B = Qwen2Shape(n_layer=24, n_embd=896, n_head=14, n_head_kv=2, n_ff=4864)
TINY = Qwen2Shape(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128)


def write_random_qwen2(
    out: Path,
    shape: Qwen2Shape,
    vocab_gguf: Path,
    weight_type: WeightType,
    seed: int,
    name: str,
    progress: Callable[[str], None] = lambda _: None,
) -> None:
    """Write a random-weight Qwen2 model to `out`, tensor by tensor (memory: one tensor)."""
    vocab = VocabGGUF.read(vocab_gguf)
    tensors = list(_tensor_plan(shape, vocab.n_tokens, weight_type))
    metadata = _metadata(shape, weight_type, name)
    with open(out, "wb") as fp:
        fp.write(struct.pack("<4sIQQ", b"GGUF", GGUF_VERSION, len(tensors), len(metadata) + len(vocab.entries)))
        for key, (vtype, value) in metadata.items():
            fp.write(_string(key) + struct.pack("<I", vtype) + _scalar(vtype, value))
        for entry in vocab.entries.values():
            fp.write(entry)
        offset = 0
        for tensor in tensors:
            dims = tensor.ggml_dims
            info = struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, tensor.ggml_type, offset)
            fp.write(_string(tensor.name) + info)
            offset += _pad(tensor.nbytes)
        _align(fp)
        rng = np.random.default_rng(seed)
        for index, tensor in enumerate(tensors, 1):
            data = tensor.make(rng)
            assert data.nbytes == tensor.nbytes, tensor.name
            data.tofile(fp)
            _align(fp)
            if index % max(1, len(tensors) // 4) == 0 or index == len(tensors):
                progress(f"{out.name}: {index}/{len(tensors)} tensors")


@dataclass(frozen=True)
class VocabGGUF:
    """The tokenizer's key/value entries of a vocab-only GGUF, as raw bytes ready to copy."""

    entries: dict[str, bytes]
    n_tokens: int

    @classmethod
    def read(cls, path: Path) -> VocabGGUF:
        data = path.read_bytes()
        magic, _version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
        if magic != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        entries: dict[str, bytes] = {}
        n_tokens = 0
        offset = 24
        for _ in range(n_kv):
            start = offset
            key, offset = _read_string(data, offset)
            (vtype,) = struct.unpack_from("<I", data, offset)
            if key == "tokenizer.ggml.tokens":
                n_tokens = struct.unpack_from("<IQ", data, offset + 4)[1]
            offset = _skip_value(data, offset + 4, GGUFValueType(vtype))
            if key in TOKENIZER_KEYS:
                entries[key] = data[start:offset]
        missing = [key for key in REQUIRED_TOKENIZER_KEYS if key not in entries]
        if missing:
            raise ValueError(f"{path}: no {', '.join(missing)} (not a vocab GGUF?)")
        return cls(entries, n_tokens)


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q", GGUFValueType.FLOAT64: "d",
}


def _read_string(data: bytes, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", data, offset)
    return data[offset + 8 : offset + 8 + n].decode(), offset + 8 + n


def _skip_value(data: bytes, offset: int, vtype: GGUFValueType) -> int:
    if vtype == GGUFValueType.STRING:
        return offset + 8 + struct.unpack_from("<Q", data, offset)[0]
    if vtype == GGUFValueType.ARRAY:
        item_type, count = struct.unpack_from("<IQ", data, offset)
        offset += 12
        if item_type == GGUFValueType.STRING:
            for _ in range(count):
                offset += 8 + struct.unpack_from("<Q", data, offset)[0]
            return offset
        return offset + count * struct.calcsize(_SCALAR_FORMATS[GGUFValueType(item_type)])
    return offset + struct.calcsize(_SCALAR_FORMATS[vtype])


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _scalar(vtype: GGUFValueType, value: Any) -> bytes:
    if vtype == GGUFValueType.STRING:
        return _string(value)
    return struct.pack("<" + _SCALAR_FORMATS[vtype], value)


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _align(fp: IO[bytes]) -> None:
    fp.write(b"\0" * (_pad(fp.tell()) - fp.tell()))


def _metadata(shape: Qwen2Shape, weight_type: WeightType, name: str) -> dict[str, tuple[GGUFValueType, Any]]:
    s, u32, f32 = GGUFValueType.STRING, GGUFValueType.UINT32, GGUFValueType.FLOAT32
    file_type = LlamaFileType.MOSTLY_Q8_0 if weight_type == "Q8_0" else LlamaFileType.MOSTLY_F16
    return {
        "general.architecture": (s, "qwen2"),
        "general.name": (s, name),
        "general.description": (s, "random weights (junk text, real compute cost), made by llm-ring"),
        "general.file_type": (u32, int(file_type)),
        "general.quantization_version": (u32, 2),
        "qwen2.context_length": (u32, shape.context_length),
        "qwen2.embedding_length": (u32, shape.n_embd),
        "qwen2.block_count": (u32, shape.n_layer),
        "qwen2.feed_forward_length": (u32, shape.n_ff),
        "qwen2.attention.head_count": (u32, shape.n_head),
        "qwen2.attention.head_count_kv": (u32, shape.n_head_kv),
        "qwen2.rope.freq_base": (f32, shape.rope_freq_base),
        "qwen2.attention.layer_norm_rms_epsilon": (f32, shape.rms_eps),
    }


@dataclass(frozen=True)
class _Tensor:
    name: str
    rows: int  # ggml ne[1] (1 for vectors): the output dimension
    cols: int  # ggml ne[0]: the input dimension
    ggml_type: GGMLQuantizationType
    fill: float | None = None  # constant value (norms, biases) instead of noise

    @property
    def ggml_dims(self) -> tuple[int, ...]:
        return (self.cols,) if self.rows == 1 else (self.cols, self.rows)

    @property
    def nbytes(self) -> int:
        if self.ggml_type == GGMLQuantizationType.Q8_0:
            return self.rows * self.cols // Q8_0_BLOCK * Q8_0_BLOCK_BYTES
        return self.rows * self.cols * (2 if self.ggml_type == GGMLQuantizationType.F16 else 4)

    def make(self, rng: np.random.Generator) -> np.ndarray[Any, Any]:
        dtype = np.float16 if self.ggml_type == GGMLQuantizationType.F16 else np.float32
        if self.fill is not None:
            return np.full((self.rows, self.cols), self.fill, dtype=dtype)
        if self.ggml_type == GGMLQuantizationType.Q8_0:
            return _random_q8_0(rng, self.rows, self.cols)
        return (rng.standard_normal((self.rows, self.cols), dtype=np.float32) * WEIGHT_STD).astype(dtype)


def _random_q8_0(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray[Any, Any]:
    blocks = np.empty((rows, cols // Q8_0_BLOCK, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    blocks[:, :, :2] = np.array([WEIGHT_STD / UNIFORM_INT8_STD], dtype=np.float16).view(np.uint8)
    blocks[:, :, 2:] = np.frombuffer(rng.bytes(rows * cols), dtype=np.uint8).reshape(rows, -1, Q8_0_BLOCK)
    return blocks


def _tensor_plan(shape: Qwen2Shape, n_vocab: int, weight_type: WeightType) -> Iterator[_Tensor]:
    """Qwen2's tensors; the output projection is tied to the embedding, as in Qwen2.5-0.5B."""
    for dim in (shape.n_embd, shape.n_ff):
        if weight_type == "Q8_0" and dim % Q8_0_BLOCK:
            raise ValueError(f"Q8_0 needs dimensions divisible by {Q8_0_BLOCK}, got {dim}")
    matrix = GGMLQuantizationType[weight_type]
    f32 = GGMLQuantizationType.F32
    d, kv = shape.n_embd, shape.n_head_kv * shape.head_dim
    yield _Tensor("token_embd.weight", n_vocab, d, matrix)
    for i in range(shape.n_layer):
        b = f"blk.{i}."
        yield _Tensor(b + "attn_norm.weight", 1, d, f32, fill=1.0)
        yield _Tensor(b + "attn_q.weight", d, d, matrix)
        yield _Tensor(b + "attn_q.bias", 1, d, f32, fill=0.0)
        yield _Tensor(b + "attn_k.weight", kv, d, matrix)
        yield _Tensor(b + "attn_k.bias", 1, kv, f32, fill=0.0)
        yield _Tensor(b + "attn_v.weight", kv, d, matrix)
        yield _Tensor(b + "attn_v.bias", 1, kv, f32, fill=0.0)
        yield _Tensor(b + "attn_output.weight", d, d, matrix)
        yield _Tensor(b + "ffn_norm.weight", 1, d, f32, fill=1.0)
        yield _Tensor(b + "ffn_gate.weight", shape.n_ff, d, matrix)
        yield _Tensor(b + "ffn_up.weight", shape.n_ff, d, matrix)
        yield _Tensor(b + "ffn_down.weight", d, shape.n_ff, matrix)
    yield _Tensor("output_norm.weight", 1, d, f32, fill=1.0)
