"""Figures to files: PNG and SVG through vl-convert (no browser needed), and one self-contained
HTML report that opens offline: the tables, the charts drawn in the page by Vega (its
JavaScript inline, the charts' rows in the page), the command and the machine.

Everything is rendered in memory first, then written beside its target and renamed into
place, so a failure leaves nothing half-written. ``page`` is pure; the rest is the shell.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import altair as alt
import vl_convert

from extproc.analysis.charts import Figure
from extproc.cli_input import UsageError

VL_VERSION = ".".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])  # the Vega-Lite Altair writes
_ESCAPED_CLOSE = "<\\/"  # "</" inside a script: the same in JavaScript and JSON strings
PNG_SCALE = 2.0  # twice the chart's CSS pixels: sharp on a page or a screen


@dataclass(frozen=True)
class Table:
    title: str
    header: list[str]
    body: list[list[str]]
    notes: tuple[str, ...] = ()  # lines shown under it


def chart_files(figures: Mapping[str, Figure]) -> dict[str, bytes]:
    """``NAME.png`` and ``NAME.svg`` of every figure."""
    files = {}
    for name, figure in figures.items():
        spec = figure.chart.to_dict()
        files[f"{name}.png"] = vl_convert.vegalite_to_png(spec, vl_version=VL_VERSION, scale=PNG_SCALE)
        files[f"{name}.svg"] = vl_convert.vegalite_to_svg(spec, vl_version=VL_VERSION).encode()
    return files


def page(title: str, command: str, machine: str, written_at: str, summary: Table,
         figures: Mapping[str, Figure], details: Sequence[Table], bundle: str) -> str:
    """The HTML report: the summary table, the charts, then ``details``; ``bundle``: ``vega_bundle()``."""
    specs = json.dumps({name: figure.chart.to_dict() for name, figure in figures.items()})
    script = bundle.replace("</script", _ESCAPED_CLOSE + "script")  # neither may end its <script> early
    charts = "".join(
        f'<h2>{html.escape(figure.title)}</h2>\n<div class="chart" id="chart-{name}"></div>\n'
        for name, figure in figures.items()
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0; }}
th, td {{ border: 1px solid #ccc; padding: 0.2em 0.6em; text-align: right; white-space: nowrap; }}
th, td:first-child {{ white-space: normal; }}  /* headers and metric names wrap: the numbers stay in view */
.wide {{ overflow-x: auto; }}
th:first-child, td:first-child {{ text-align: left; }}
.meta {{ color: #555; }} .note {{ color: #555; font-size: 0.9em; }}
</style></head><body>
<h1>{html.escape(title)}</h1>
<p class="meta">command: <code>{html.escape(command)}</code><br>machine: {html.escape(machine)}<br>
written: {html.escape(written_at)}</p>
{_table(summary)}{charts}{"".join(_table(table) for table in details)}
<script type="application/json" id="specs">{specs.replace("</", _ESCAPED_CLOSE)}</script>
<script>{script}</script>
</body></html>
"""


def _table(table: Table) -> str:
    head = "".join(f"<th>{html.escape(cell)}</th>" for cell in table.header)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in row) + "</tr>\n"
                   for row in table.body)
    notes = "".join(f'<p class="note">{html.escape(note)}</p>\n' for note in table.notes)
    return (f'<h2>{html.escape(table.title)}</h2>\n<div class="wide"><table><tr>{head}</tr>\n{rows}</table></div>\n'
            f"{notes}")


# draws every spec of the page's "specs" into its <div id="chart-NAME">, as SVG
_EMBED = """
const specs = JSON.parse(document.getElementById("specs").textContent);
for (const [name, spec] of Object.entries(specs)) {
  const where = document.getElementById("chart-" + name);
  vegaEmbed(where, spec, {renderer: "svg", actions: false})
    .catch((error) => { where.textContent = "this chart failed to draw: " + error; });
}
"""


def vega_bundle() -> str:
    """Vega, Vega-Lite and vega-embed with the page's drawing code, as one script (built by
    vl-convert, nothing downloaded)."""
    return vl_convert.javascript_bundle(_EMBED, vl_version=VL_VERSION)


def machine() -> str:
    """Where the report was made: host, CPU, cores, OS, Python, load."""
    cpu = next((line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
               platform.processor() or platform.machine())
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()} "
            f"{platform.machine()}, Python {platform.python_version()}, load average {load}")


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def check_target(path: Path, flag: str, folder: bool) -> Path:
    """A file or folder we may write: not the other kind, in a folder that exists and is writable."""
    if path.exists() and path.is_dir() != folder:
        wanted, found = ("folder", "file") if folder else ("file", "folder")
        raise UsageError(f"{flag} {path}: is a {found}, not a {wanted}")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable")
    return path


def write_folder(path: Path, files: Mapping[str, bytes]) -> None:
    """``files`` into the folder ``path``: written in a temporary folder beside it, then renamed
    into place (a folder that exists keeps its other files; each of ours replaces its old one)."""
    staging = Path(tempfile.mkdtemp(dir=path.absolute().parent, prefix=f".{path.name}.", suffix=".partial"))
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
            (staging / name).chmod(0o644)
        if not path.exists():
            staging.chmod(0o755)
            staging.rename(path)
            return
        for name in files:
            os.replace(staging / name, path / name)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
