"""Every notebook in notebooks/ runs top to bottom in a real IPython kernel."""

from __future__ import annotations

from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    outputs = "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )
    assert "cell traces match plain hooks" in outputs
    assert "backward in a cell works" in outputs


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no notebook"
