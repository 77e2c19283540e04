"""The documents against the code: every `llm-ring` command shown in README.md, docs/*.md and the
results logs (docs/results/*.md), in a code block or inline, names a real command and only its real
options (a full command line parses with the real argument parser); every setting named exists in
the settings schema; every link lands; the fast commands run and the README's results table is what
its command prints; README.md stays within 250 lines and every reference page within 300; no page
cites a commit of this repository (history lives in the dated results logs, told in words)."""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from extproc.cli import COMMANDS, build_parser, main
from extproc.routing import POLICIES
from extproc.routing.policies.plugin import param_names
from extproc.routing.replica_facts import ReplicaFacts
from extproc.settings import DiscoverySettings, Settings

ROOT = Path(__file__).resolve().parents[2]
REFERENCE_PAGES = sorted((ROOT / "docs").glob("*.md"))
RESULTS_LOGS = sorted((ROOT / "docs" / "results").glob("*.md"))
PAGES = [ROOT / "README.md", *REFERENCE_PAGES, *RESULTS_LOGS]
MAX_LINES = {"README.md": 250} | {page.name: 300 for page in REFERENCE_PAGES}
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


INLINE = re.compile(r"`(?:\.venv/bin/)?llm-ring ([^`]+)`")


def inline_commands(page: Path) -> list[tuple[str, list[str]]]:
    """(span as written, tokens after `llm-ring`) for every `llm-ring ...` code span in the prose."""
    found = []
    for rest in INLINE.findall(FENCE.sub("", page.read_text())):
        tokens = shlex.split(rest)
        if tokens and not PLACEHOLDER.match(tokens[0]) and tokens[0].strip(".…"):  # `llm-ring COMMAND`, `llm-ring ...`
            found.append((f"llm-ring {rest}", tokens))
    return found


ALL_COMMANDS = [(page.name, line, tokens) for page in PAGES for line, tokens in commands(page)]
ALL_INLINE = [(page.name, span, tokens) for page in PAGES for span, tokens in inline_commands(page)]


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


def check_synopsis(page: str, line: str, tokens: list[str]) -> None:
    """The command exists, its subcommand too when one is named, and every flag named is one of its options."""
    command = tokens[0]
    assert command in COMMANDS, f"{page}: unknown command in {line!r}"
    parser = subcommand_parser(command)
    subcommands = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if subcommands is not None and len(tokens) > 1 and re.fullmatch(r"[(]?[a-z][a-z|-]*[)]?", tokens[1]):
        named = tokens[1].strip("()").split("|")
        unknown_sub = sorted(name for name in named if name not in subcommands)
        assert not unknown_sub, f"{page}: {line!r} names {unknown_sub}, not subcommands of `llm-ring {command}`"
    known = options(parser)
    flags = {re.sub(r"=.*$", "", token.strip("[]()|.,")) for token in tokens}
    unknown = sorted(flag for flag in flags if flag.startswith("--") and flag not in known)
    assert not unknown, f"{page}: {line!r} names {unknown}, not options of `llm-ring {command}`"


@pytest.mark.parametrize("page, line, tokens", ALL_COMMANDS,
                         ids=[f"{page}: {line[:70]}" for page, line, _ in ALL_COMMANDS])
def test_every_command_line_parses(page, line, tokens):
    if any(mark in token for token in tokens for mark in SYNOPSIS_MARKS) or any(
            PLACEHOLDER.match(token) for token in tokens):
        check_synopsis(page, line, tokens)  # a synopsis: every flag it names must exist
    else:
        assert tokens[0] in COMMANDS, f"{page}: unknown command in {line!r}"
        try:
            build_parser(tokens).parse_args(tokens)
        except SystemExit:
            pytest.fail(f"{page}: {line!r} does not parse")


@pytest.mark.parametrize("page, span, tokens", ALL_INLINE,
                         ids=[f"{page}: {span[:70]}" for page, span, _ in ALL_INLINE])
def test_every_inline_command_names_real_options(page, span, tokens):
    check_synopsis(page, span, tokens)  # prose quotes part of a command: its words must exist


SECTIONS = "|".join(Settings.model_fields)
# routing.<policy>.<key> and discovery.<source>.<key> too; the rest: "unknown setting" and "moved to" examples
SETTING = re.compile(rf"`({SECTIONS})\.((?:[a-z-]+\.)?[a-z_]+)([^`]*)`")
VARIABLE = re.compile(r"LLM_RING__([A-Z]+)__([A-Z_]+)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_setting_named_exists(page):
    text = page.read_text()
    sections = {name: set(field.annotation.model_fields) for name, field in Settings.model_fields.items()}
    sections["routing"] |= {f"{policy}.{key}" for policy in POLICIES for key in param_names(policy)}
    sections["routing"] |= {f"replicas.{key}" for key in ReplicaFacts.model_fields}
    sections["discovery"] |= {f"{source}.{key}" for source, model in DiscoverySettings.named_sections().items()
                              for key in model.model_fields}
    named = [(section, key) for section, key, rest in SETTING.findall(text)
             if "unknown setting" not in rest and "moved to" not in rest]
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


@pytest.mark.parametrize("page", [ROOT / "README.md", *REFERENCE_PAGES], ids=lambda p: p.name)
def test_every_page_keeps_within_its_length(page):
    lines = len(page.read_text().splitlines())
    assert lines <= MAX_LINES[page.name], (
        f"{page.name} has {lines} lines, more than {MAX_LINES[page.name]}: move history to docs/results/")


HEX = re.compile(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w/-])")


def commits_of_this_repository(words: list[str]) -> list[str]:
    """The words that name a commit in this checkout's git history."""
    answer = subprocess.run(["git", "-C", str(ROOT), "cat-file", "--batch-check=%(objecttype)"],
                            input="".join(f"{word}^{{commit}}\n" for word in words),
                            capture_output=True, text=True, check=True).stdout.splitlines()
    return [word for word, kind in zip(words, answer, strict=True) if kind == "commit"]


def test_the_hex_finder_sees_a_hash_in_prose():
    assert HEX.findall("at git 1a2b3c4 and (kgateway `c217da8a539570ba3f6014a60c2687c29a945f1f`)") == [
        "1a2b3c4", "c217da8a539570ba3f6014a60c2687c29a945f1f"]
    assert HEX.findall("0xdeadbeef ab12cd3-branch path/abcdef12 10000000") == ["10000000"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_no_page_cites_a_commit_of_this_repository(page):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: no history to compare the page's hashes with")
    words = sorted({word for word in HEX.findall(page.read_text()) if re.search(r"[a-f]", word)})
    own = commits_of_this_repository(words) if words else []
    assert not own, f"{page.name} cites this repository's commits {own}: say what changed, not where"
