import json
from pathlib import Path

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient

from analysis.fixtures import make_experiment
from extproc.analysis.report import resolve_folders
from extproc.cli import main

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.live  # starts a Jupyter kernel
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_two_folders_side_by_side_and_shows_every_chart(notebook, tmp_path, capsys, monkeypatch):
    live, sim = make_experiment(tmp_path / "live"), tmp_path / "sim"
    # a real simulation of a mixed fleet with a slowdown: its llm-aware runs write speeds.parquet
    assert main(["sim", "--profile", "quick", "--policies", "bounded", "llm-aware", "--seeds", "1-2",
                 "--cost-model", "smollm2-135m:1", "qwen05b-shape:1", "--slow", "llm-1:4:3",
                 "--out-dir", str(sim)]) == 0  # fmt: skip
    capsys.readouterr()
    monkeypatch.setenv("LLM_RING_EXPERIMENT_DIRS", f"{live}:{sim}")
    executed = nbformat.read(notebook, as_version=4)
    NotebookClient(executed, timeout=300, resources={"metadata": {"path": str(tmp_path)}}).execute()
    chart_cells = [cell for cell in executed.cells if cell.cell_type == "code" and cell.source.startswith("show(")]
    silent = [cell.source for cell in chart_cells
              if not any("text/html" in output.get("data", {}) for output in cell.outputs)]  # fmt: skip
    assert len(chart_cells) == 5 and not silent, f"chart cells that show no chart: {silent}"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs_and_paired(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    assert all(not c.get("outputs") and not c.get("execution_count") for c in cells if c["cell_type"] == "code")
    paired = jupytext.read(notebook.with_suffix(".py"))
    assert [c.source for c in paired.cells] == [c.source for c in jupytext.read(notebook).cells]


def test_there_are_notebooks():
    assert NOTEBOOKS


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_the_first_cell_names_the_folders(notebook):
    first = json.loads(notebook.read_text())["cells"][0]
    assert first["cell_type"] == "code" and "FOLDERS = [" in "".join(first["source"])


def test_relative_folders_are_read_from_the_repository_root(tmp_path):
    root = Path(__file__).parents[2]
    assert resolve_folders(["results/x", str(tmp_path)]) == [root / "results" / "x", tmp_path]
