import json
import os
import subprocess
import sys
from pathlib import Path

import jupytext
import pytest

from analysis.fixtures import make_experiment
from extproc.analysis.report import resolve_folders

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.live  # starts a Jupyter kernel
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_on_two_folders_side_by_side(notebook, tmp_path):
    live, sim = make_experiment(tmp_path / "live"), make_experiment(tmp_path / "sim")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake", str(notebook)],
        env={**os.environ, "LLM_RING_EXPERIMENT_DIRS": f"{live}:{sim}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]


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
