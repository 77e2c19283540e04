"""Writing a file so that a reader sees the old content or the new, never half of it."""

from __future__ import annotations

import contextlib
import os
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
