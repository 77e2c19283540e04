"""Random LoRA adapters for a GGUF model, in llama.cpp's adapter format.

llama.cpp loads an adapter (``--lora FILE``, src/llama-adapter.cpp) from a GGUF whose
``general.type`` is ``adapter``, ``adapter.type`` ``lora`` and ``general.architecture`` the base
model's, with a pair of tensors per adapted weight W of the base (ggml shape [in, out]):
``<W>.lora_a`` of shape [in, rank] and ``<W>.lora_b`` of shape [rank, out]. A request's scale S
adds S x alpha / rank x B·A to W. Here every attention projection of every layer is adapted,
rank 8, alpha = rank, A and B float32 noise whose product has a standard deviation of
DELTA_STD (a tenth of random_gguf's weights): the base model's answers stay sane. The shapes
are read from the base file, so one generator serves every model; the output is a
deterministic function of (base file, seed, rank, name).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter, Keys

RANK = 8
DELTA_STD = 0.002  # of B·A's entries, at scale 1
TARGETS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output"})  # blk.N.<target>.weight


def adapted(name: str) -> bool:
    """A base tensor an adapter adapts: a layer's attention projection weight."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in TARGETS and parts[3] == "weight"


def write_random_lora(out: Path, base: Path, seed: int, name: str, rank: int = RANK) -> None:
    """Write a random LoRA adapter for the model in ``base`` to ``out``."""
    reader = GGUFReader(base)
    writer = GGUFWriter(out, str(reader.fields[Keys.General.ARCHITECTURE].contents()))
    writer.add_type("adapter")
    writer.add_name(name)
    writer.add_string(Keys.Adapter.TYPE, "lora")
    writer.add_float32(Keys.Adapter.LORA_ALPHA, float(rank))
    rng = np.random.default_rng(seed)
    std = float(np.sqrt(DELTA_STD / np.sqrt(rank)))  # each factor's: B·A sums rank products
    for tensor in reader.tensors:
        if not adapted(tensor.name):
            continue
        columns, rows = int(tensor.shape[0]), int(tensor.shape[1])  # ggml's [in, out]
        writer.add_tensor(f"{tensor.name}.lora_a", (rng.standard_normal((rank, columns)) * std).astype(np.float32))
        writer.add_tensor(f"{tensor.name}.lora_b", (rng.standard_normal((rows, rank)) * std).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
