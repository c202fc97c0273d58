"""The notebooks in notebooks/: each runs top to bottom in a fresh kernel, and the committed
files are current (built from their notebooks/src source, with outputs and pictures)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("build_notebooks", ROOT / "scripts" / "build_notebooks.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

SOURCES = sorted(build.SOURCES.glob("*.py"))
NAMES = [p.stem for p in SOURCES]


def _notebook(name):
    return nbformat.read(build.NOTEBOOKS / f"{name}.ipynb", as_version=4)


def _raises(cell) -> bool:
    return build.RAISES in cell.metadata.get("tags", [])


def _errors(cell) -> list:
    return [o for o in cell.get("outputs", []) if o.output_type == "error"]


def test_the_three_notebooks_exist():
    """The notebooks the README describes each have a source and a committed notebook."""
    assert {"walkthrough", "gradients", "patching_and_lens"} <= set(NAMES)
    assert {p.stem for p in build.NOTEBOOKS.glob("*.ipynb")} == set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_matches_its_source(name):
    """The committed cells (kind, text, tags) are what the source builds: a notebook edited
    without rebuilding, or a source edited without re-running, fails here."""
    built = build.notebook_from_source(build.SOURCES / f"{name}.py")
    committed = _notebook(name)
    def shape(nb):
        return [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in nb.cells]
    assert shape(committed) == shape(built), f"rebuild: python scripts/build_notebooks.py {name}"


@pytest.mark.parametrize("name", NAMES)
def test_committed_notebook_has_its_outputs(name):
    """Every code cell was run in order and has output; only cells tagged raises-exception
    show an error, and each of those does; there is a picture; progress bars read finished."""
    nb = _notebook(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    for i, cell in enumerate(code):
        assert cell.outputs, f"code cell {i} has no output: {cell.source[:80]!r}"
        assert bool(_errors(cell)) == _raises(cell), f"code cell {i}: {cell.source[:80]!r}"
    pictures = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert pictures, "no picture"
    for c in code:
        for o in c.outputs:
            if "application/vnd.jupyter.widget-view+json" in o.get("data", {}):
                assert "100%" in o.data["text/plain"], o.data["text/plain"]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_in_a_fresh_kernel(name):
    """The notebook runs top to bottom in a fresh kernel: every assert in it against plain
    PyTorch holds; only tagged cells raise, and they do."""
    nb = build.notebook_from_source(build.SOURCES / f"{name}.py")
    build.execute(nb)  # raises CellExecutionError at the first untagged cell that fails
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert bool(_errors(cell)) == _raises(cell), cell.source[:80]
