"""No class over 300 lines and no function over 60 in extproc (generated code aside): a unit
that size does one job and reads on a screen or so."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 60
GENERATED = ("_pb2.py", "_pb2_grpc.py")  # protoc's output


def oversized(source: str) -> list[tuple[str, int]]:
    """(name, lines) of every class over MAX_CLASS_LINES and function over MAX_FUNCTION_LINES,
    nested ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            lines = node.end_lineno - node.lineno + 1  # type: ignore[operator]
            if lines > (MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES):
                found.append((node.name, lines))
    return found


def extproc_oversized() -> dict[tuple[str, str], int]:
    found = {}
    for path in sorted((ROOT / "extproc").rglob("*.py")):
        if not path.name.endswith(GENERATED):
            for name, lines in oversized(path.read_text()):
                found[path.relative_to(ROOT).as_posix(), name] = lines
    return found


def test_no_class_or_function_is_over_its_limit() -> None:
    over = extproc_oversized()
    assert not over, f"over {MAX_CLASS_LINES} lines (a class) or {MAX_FUNCTION_LINES} (a function): {over}"


def test_the_measure_finds_a_long_function_and_a_long_class() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    assert oversized(f"def f():\n{body}") == [("f", MAX_FUNCTION_LINES + 1)]
    assert oversized(f"def f():\n{body[: body.rindex('    x')]}") == []
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_CLASS_LINES // 2))
    assert oversized(f"class C:\n{methods}") == [("C", MAX_CLASS_LINES + 1)]
    assert oversized(f"class C:\n{methods[: methods.rindex('    def')]}") == []
