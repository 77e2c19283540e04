"""Regenerates extproc/service/admin_pb2*.py from proto/admin.proto (grpcio-tools, dev only).

The generated modules are committed so that running the service needs no compiler; a test
checks they match the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def generate(out_dir: Path = ROOT) -> int:
    from grpc_tools import protoc

    # The virtual path extproc/service/admin.proto makes the stubs import each other as
    # `from extproc.service import admin_pb2`.
    return protoc.main(
        [
            "protoc",
            f"-Iextproc/service={ROOT / 'proto'}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            "extproc/service/admin.proto",
        ]
    )


if __name__ == "__main__":
    sys.exit(generate())
