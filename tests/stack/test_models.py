"""The models' data directory: where it is, checksums recorded at prepare and verified on use."""

from __future__ import annotations

from pathlib import Path

import pytest

from extproc.stack import models


def test_data_dir_flag_then_environment_then_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(models.DATA_ENV, str(tmp_path / "env"))
    assert models.data_dir(tmp_path / "flag") == tmp_path / "flag"
    assert models.data_dir() == tmp_path / "env"
    monkeypatch.delenv(models.DATA_ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert models.data_dir() == tmp_path / "home" / ".local" / "share" / "llm-ring"


def test_smollm2_is_copied_recorded_and_verified(tmp_path: Path) -> None:
    assert models.status("smollm2", tmp_path) == "missing"
    prepared = models.prepare("smollm2", tmp_path, progress=lambda _: None)
    path = Path(prepared.path)
    assert path.read_bytes()[:4] == b"GGUF"
    assert prepared.sha256 == models.sha256_file(models.smollm2_gguf())
    assert models.status("smollm2", tmp_path) == "ready"
    assert models.verify("smollm2", tmp_path, lambda _: None) == prepared
    assert models.resolve("smollm2", tmp_path, lambda _: None) == path


def test_a_changed_file_fails_verification_and_prepare_repairs_it(tmp_path: Path) -> None:
    prepared = models.prepare("smollm2", tmp_path, progress=lambda _: None)
    path = Path(prepared.path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # same size: only the checksum notices
    with pytest.raises(models.ModelError, match="smollm2.*sha256.*--force"):
        models.verify("smollm2", tmp_path, lambda _: None)
    messages: list[str] = []
    repaired = models.prepare("smollm2", tmp_path, progress=messages.append)
    assert repaired.sha256 == prepared.sha256
    assert any("preparing it again" in m for m in messages)


def test_unknown_names_and_paths_are_named_in_the_error(tmp_path: Path) -> None:
    with pytest.raises(models.ModelError, match="'gpt-9'.*smollm2"):
        models.resolve("gpt-9", tmp_path)
    with pytest.raises(models.ModelError, match="unknown model 'gpt-9'"):
        models.verify("gpt-9", tmp_path)
    with pytest.raises(models.ModelError, match="not prepared.*models prepare tiny"):
        models.verify("tiny", tmp_path)
    own = tmp_path / "mine.gguf"
    own.write_bytes(b"GGUF")
    assert models.resolve(str(own), tmp_path) == own
