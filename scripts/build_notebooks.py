"""Build the notebooks in notebooks/ from their sources in notebooks/src/, and run them.

    python scripts/build_notebooks.py                 # every notebook: build, execute, write
    python scripts/build_notebooks.py gradients       # only notebooks/gradients.ipynb
    python scripts/build_notebooks.py --no-execute    # cells only (no outputs)

A source is a Python file in the "percent" format: ``# %%`` opens a code cell,
``# %% [markdown]`` a markdown cell whose lines are comments, and ``# %% tags=["raises-exception"]``
tags a code cell (one that is meant to raise). Executing runs the notebook top to bottom in a
fresh IPython kernel (nbclient + ipykernel) whose ``nnsight_lite`` is this checkout's, and stores
the outputs, pictures included, so the notebooks read well without running them.
tests/notebooks checks that each committed notebook still matches its source and has its outputs.
"""

from __future__ import annotations

import ast
import base64
import html
import os
import re
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = NOTEBOOKS / "src"
RAISES = "raises-exception"
_HEADER = re.compile(r"^# %%(?P<md> \[markdown\])?(?: tags=(?P<tags>\[.*\]))?\s*$")


def cells_from_source(text: str) -> list:
    """The notebook cells a percent-format source describes, in order."""
    cells = []
    kind, tags, lines = None, [], []

    def flush():
        if kind is None:
            return
        body = "\n".join(lines).strip("\n")
        if kind == "markdown":
            body = "\n".join(re.sub(r"^# ?", "", ln) for ln in body.splitlines())
            cell = nbformat.v4.new_markdown_cell(body)
        else:
            cell = nbformat.v4.new_code_cell(body)
        if tags:
            cell.metadata["tags"] = list(tags)
        cells.append(cell)

    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            flush()
            kind = "markdown" if m["md"] else "code"
            tags = ast.literal_eval(m["tags"]) if m["tags"] else []
            lines = []
        elif kind is not None:
            lines.append(line)
    flush()
    return cells


def notebook_from_source(path: Path):
    """A new notebook (no outputs) from the source file ``path``."""
    nb = nbformat.v4.new_notebook()
    nb.cells = cells_from_source(path.read_text())
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"{path.stem[:20]}-{i}"  # stable ids: rebuilding gives the same file
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def kernel_env() -> dict:
    """The environment a notebook kernel gets: this checkout first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TQDM_MININTERVAL", "1")
    return env


def execute(nb, *, timeout: int = 600):
    """Run ``nb`` top to bottom in a fresh kernel; cells tagged raises-exception may raise.

    Returns the notebook with its outputs; any other error raises nbclient's CellExecutionError.
    """
    import nbclient

    saved = dict(os.environ)
    os.environ.update(kernel_env())  # the kernel process inherits this environment
    try:
        client = nbclient.NotebookClient(
            nb, timeout=timeout, kernel_name="python3", record_timing=False,
            resources={"metadata": {"path": str(NOTEBOOKS)}},
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return nb


def finish_progress_bars(nb) -> None:
    """Give each tqdm notebook bar's plain-text view its final state.

    A bar is a widget whose final state the kernel stores in the notebook's metadata; the
    text shown where widgets do not render (a code host) is what the bar said when it first
    appeared, 0%. Rewrite that text from the stored state, so it reads as the run ended.
    """
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {})
    models = state.get("state", {})

    def model(ref):
        return models.get(ref.removeprefix("IPY_MODEL_"), {}).get("state", {})

    for cell in nb.cells:
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            parts = [model(c) for c in model(view["model_id"]).get("children", [])] if view else []
            if len(parts) != 3 or "max" not in parts[1]:
                continue
            left, bar, right = parts
            filled = round(10 * bar["value"] / bar["max"]) if bar["max"] else 10
            text = f"{left['value']}|{'█' * filled}{' ' * (10 - filled)}|{right['value']}"
            out["data"]["text/plain"] = html.unescape(text).replace("\u2007", " ")


def export_picture(nb, name: str) -> Path | None:
    """Write the notebook's first picture to notebooks/images/<name>.png (the README shows one)."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png")
            if png:
                target = NOTEBOOKS / "images" / f"{name}.png"
                target.parent.mkdir(exist_ok=True)
                target.write_bytes(base64.b64decode(png))
                return target
    return None


def build(name: str, *, run: bool = True) -> Path:
    source = SOURCES / f"{name}.py"
    nb = notebook_from_source(source)
    if run:
        start = time.perf_counter()
        execute(nb)
        finish_progress_bars(nb)
        export_picture(nb, name)
        print(f"{name}: executed in {time.perf_counter() - start:.0f} s")
    target = NOTEBOOKS / f"{name}.ipynb"
    nbformat.write(nb, target)
    return target


def main(argv: list[str]) -> None:
    run = "--no-execute" not in argv
    names = [a for a in argv if not a.startswith("--")] or sorted(p.stem for p in SOURCES.glob("*.py"))
    for name in names:
        print("wrote", build(name, run=run).relative_to(ROOT))


if __name__ == "__main__":
    main(sys.argv[1:])
