"""The documents against the code: every `llm-ring` command line shown in README.md and docs/*.md
parses with the real argument parser, every setting named exists in the settings schema, the fast
commands run, and the README's results table is what its command prints."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from extproc.cli import COMMANDS, build_parser, main
from extproc.routing import POLICIES
from extproc.routing.policies.plugin import param_names
from extproc.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_:.]*$")  # N, DIR, FILE, T:N ...
SYNOPSIS_MARKS = ("[", "]", "(", ")", "|", "..")


def commands(page: Path) -> list[tuple[str, list[str]]]:
    """(line as written, tokens after `llm-ring`) for every command line in the page's code blocks."""
    found = []
    for block in FENCE.findall(page.read_text()):
        lines = block.replace("\\\n", " ").splitlines()
        for number, line in enumerate(lines):
            text = re.sub(r"^\s*\$\s+", "", line)
            match = re.match(r"^\s*(?:[A-Z_]+=\S+\s+)*(?:\.venv/bin/)?llm-ring\s+(.*)$", text)
            if not match:
                continue
            rest = match.group(1)
            for following in lines[number + 1:]:  # a synopsis continues on indented lines
                if re.match(r"^\s{5,}[\[-]", following):
                    rest += " " + following
                else:
                    break
            found.append((line.strip(), shlex.split(re.sub(r"\s+#.*$", "", rest))))
    return found


ALL_COMMANDS = [(page.name, line, tokens) for page in PAGES for line, tokens in commands(page)]


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of a parser and of its subcommands."""
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options(sub)
    return found


def subcommand_parser(command: str) -> argparse.ArgumentParser:
    parser = build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def test_the_documents_show_commands():
    assert len(ALL_COMMANDS) > 30
    assert {name for name, _, _ in ALL_COMMANDS} >= {"README.md", "simulator.md", "experiments.md"}


@pytest.mark.parametrize("page, line, tokens", ALL_COMMANDS,
                         ids=[f"{page}: {line[:70]}" for page, line, _ in ALL_COMMANDS])
def test_every_command_line_parses(page, line, tokens):
    command = tokens[0]
    assert command in COMMANDS, f"{page}: unknown command in {line!r}"
    if any(mark in token for token in tokens for mark in SYNOPSIS_MARKS) or any(
            PLACEHOLDER.match(token) for token in tokens):
        # a synopsis: every flag it names must exist
        known = options(subcommand_parser(command))
        flags = {re.sub(r"=.*$", "", token.strip("[]()|.")) for token in tokens}
        unknown = sorted(flag for flag in flags if flag.startswith("--") and flag not in known)
        assert not unknown, f"{page}: {line!r} names {unknown}, not options of `llm-ring {command}`"
    else:
        try:
            build_parser(tokens).parse_args(tokens)
        except SystemExit:
            pytest.fail(f"{page}: {line!r} does not parse")


# routing.<policy>.<key> too; the rest: "unknown setting" examples
SETTING = re.compile(r"`(routing|service|discovery)\.((?:[a-z-]+\.)?[a-z_]+)([^`]*)`")
VARIABLE = re.compile(r"LLM_RING__([A-Z]+)__([A-Z_]+)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_setting_named_exists(page):
    text = page.read_text()
    sections = {name: set(field.annotation.model_fields) for name, field in Settings.model_fields.items()}
    sections["routing"] |= {f"{policy}.{key}" for policy in POLICIES for key in param_names(policy)}
    named = [(section, key) for section, key, rest in SETTING.findall(text) if "unknown setting" not in rest]
    named += [(section.lower(), _variable_key(key)) for section, key in VARIABLE.findall(text) if section != "SECTION"]
    unknown = sorted(f"{section}.{key}" for section, key in named if key not in sections[section])
    assert not unknown, f"{page.name} names settings that do not exist: {unknown}"


def _variable_key(name: str) -> str:
    """A variable's key as a setting's: LLM_AWARE__TTFT_MARGIN is llm-aware.ttft_margin."""
    *policy, key = name.lower().split("__")
    return ".".join([*(part.replace("_", "-") for part in policy), key])


def readme_command(prefix: str) -> list[str]:
    matches = [tokens for page, _, tokens in ALL_COMMANDS
               if page == "README.md" and " ".join(tokens).startswith(prefix)]
    assert matches, f"README.md shows no `llm-ring {prefix}`"
    return matches[0]


def with_out_dir(tokens: list[str], out: Path) -> list[str]:
    i = tokens.index("--out-dir")
    return [*tokens[: i + 1], str(out), *tokens[i + 2:]]


def test_the_quickstart_simulator_path_runs(tmp_path, capsys):
    sim = readme_command("sim --profile quick")
    assert main(with_out_dir(sim, tmp_path / "quick-sim")) == 0
    assert "metric (mean ± 95% CI over seeds)" in capsys.readouterr().out
    report = readme_command("report results/quick-sim")
    assert main(["report", str(tmp_path / "quick-sim"), *report[2:]]) == 0
    assert "Cache hit rate (follow-up turns)" in capsys.readouterr().out


def numbers(cell: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", cell.replace(",", ""))


def test_the_readme_results_table_is_what_its_command_prints(tmp_path, capsys):
    sim = readme_command("sim --profile standard")
    assert main(with_out_dir(sim, tmp_path / "standard")) == 0
    printed: dict[str, str] = {}
    for line in capsys.readouterr().out.splitlines():  # per-policy rows first, the paired ones after
        printed.setdefault(re.split(r"\s{2,}", line)[0], line)
    table = [line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| ")]
    start = next(i for i, line in enumerate(table) if "over 20 seeds" in line)
    rows = [line.strip("|").split("|") for line in table[start + 1:] if not line.startswith("|---")]
    checked = 0
    for label, *cells in rows[:5]:
        key = next((name for name in printed if name.startswith(label.strip().split(" (")[0])), None)
        assert key, f"README row {label.strip()!r} not printed by `llm-ring {' '.join(sim)}`"
        out = numbers(printed[key][len(key):])
        for shown, expected in zip(numbers(cells[0]) + numbers(cells[1]), out, strict=False):
            digits = len(shown.partition(".")[2])
            assert f"{float(expected):.{digits}f}" == shown, f"{label.strip()}: README {shown}, printed {expected}"
            checked += 1
    assert checked >= 16


LINK = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", page.read_text())
    headings = re.findall(r"^#+\s+(.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_between_pages_lands(page):
    broken = []
    for target, anchor in LINK.findall(FENCE.sub("", page.read_text())):
        if target.startswith(("http://", "https://")):
            continue
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}#{anchor}")
    assert not broken, f"{page.name}: links to nothing: {broken}"
