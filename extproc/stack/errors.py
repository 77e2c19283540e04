"""What every room of the local stack reports with: its error and its progress callback."""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]


class StackError(RuntimeError):
    """The stack cannot do what was asked; the message says what and how to fix it."""
