"""Writing files: so that a reader sees the old content or the new, never half of it; or
readable by their owner alone (secrets)."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, data: str | bytes, mode: int = 0o644) -> Path:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``.

    mode: the file's permissions (the temporary file starts as 0600; a reader may run as
    another user, e.g. Envoy reading the endpoints file in Kubernetes)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def write_private(path: str | Path, text: str) -> None:
    """Write ``text`` readable by the owner only, from the file's creation on (never briefly
    world-readable)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    os.chmod(path, 0o600)


def private_secret(path: str | Path) -> str:
    """The secret in ``path``, made (48 random hex digits, written by write_private) when the
    file is not there yet: a secret generated once and kept."""
    path = Path(path)
    if path.exists():
        return path.read_text().strip()
    secret = secrets.token_hex(24)
    write_private(path, secret + "\n")
    return secret
