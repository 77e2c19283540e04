"""Checked command-line input, shared by every `llm-ring` command.

Bad input ends the command with exit code 2 and one line on stderr that names the
problem and where the value came from (a flag, a file, an environment variable):
argparse's own errors through ``OneLineParser``, the commands' checks by raising
``UsageError``, which ``extproc.cli.main`` catches once. Checks run before anything is
written, so a refused command leaves no folder behind.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn


class UsageError(ValueError):
    """Bad input; the message starts with where it came from (``--seeds: ...``, ``FILE: ...``)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but an error is one line (the usage stays behind ``--help``)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def report_usage_error(command: str, exc: Exception) -> int:
    print(f"llm-ring {command}: {exc}", file=sys.stderr)
    return 2


def at_least(low: float, kind: Callable[[str], float] = int) -> Callable[[str], float]:
    """An argparse ``type``: a number >= ``low`` (the message names the bound)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low:g} (got {text})")
        return value

    return parse


def parse_seeds(items: Sequence[str], flag: str = "--seeds") -> list[int]:
    """Integers and ranges like ``1-20``; an empty range or a seed given twice is refused."""
    seeds: list[int] = []
    for item in items:
        low, sep, high = item.partition("-")
        try:
            chunk = list(range(int(low), int(high) + 1)) if sep and low else [int(item)]
        except ValueError:
            raise UsageError(f"{flag}: {item!r} is not an integer or a range like 1-20") from None
        if not chunk:
            raise UsageError(f"{flag}: {item!r} is an empty range (write the lower seed first: {high}-{low})")
        seeds += chunk
    distinct(seeds, flag, "seed ")
    return seeds


def distinct(values: Sequence[object], flag: str, noun: str = "") -> None:
    """Refuse a value given twice (two runs, or two folders, would be the same)."""
    twice = sorted({str(value) for value in values if values.count(value) > 1})
    if twice:
        raise UsageError(f"{flag}: {noun}{', '.join(twice)} given twice")


def new_folder(path: Path, flag: str = "--out-dir") -> Path:
    """A folder that does not exist yet and can be created (checked, not created)."""
    if path.exists():
        kind = "a folder" if path.is_dir() else "a file"
        raise UsageError(f"{flag} {path}: already exists ({kind}); choose a new folder per experiment")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{flag} {path}: {parent} is a file, not a folder")
            break
    return path
