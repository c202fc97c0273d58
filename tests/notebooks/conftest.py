"""A real IPython kernel (ipykernel, through jupyter_client) that tests send cells to.

``kernel.run(code)`` executes one cell and returns a :class:`Cell` with what the kernel sent
back: stdout, the cell's displayed value, its error (name, value, traceback). The kernel imports
this checkout's ``nnsight_lite`` and holds a small model, ``model`` (``NNsight`` around ``net``),
an input ``x``, and ``leftovers()``: the hooks, wrappers, suspended bodies and torch modes that
tests/conftest.py's guard looks for, inside the kernel process.
"""

from __future__ import annotations

import ast
import os
import queue
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

SETUP = """
import torch
import nnsight_lite
from nnsight_lite import NNsight
from tests.conftest import _leftovers

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
model = NNsight(net)
x = torch.randn(3, 4)

def leftovers():
    bad = _leftovers()
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        bad.append("grad mode changed")
    if getattr(torch.Tensor.backward, "__nnsight_lite__", False) is not True:
        bad.append("Tensor.backward is not the patched original")
    return bad
"""


@dataclass
class Cell:
    """What one executed cell produced."""

    stdout: str = ""
    stderr: str = ""
    results: list = field(default_factory=list)  # text/plain of execute_result / display_data
    error: dict | None = None                    # {"ename", "evalue", "traceback" (plain text)}

    @property
    def text(self) -> str:
        return "\n".join(self.results)


class Kernel:
    """One kernel process; ``run`` sends a cell and waits for it to finish."""

    def __init__(self):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.manager = jupyter_client.KernelManager(kernel_name="python3")
        self.manager.start_kernel(env=env, cwd=str(ROOT))
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        cell = self.run(SETUP)
        assert cell.error is None, cell.error

    def run(self, code: str, *, timeout: float = 60, interrupt_after: str | None = None,
            delay: float = 0.0) -> Cell:
        """Execute ``code`` as one cell. With ``interrupt_after``, send SIGINT through the kernel
        manager ``delay`` seconds after that text first appears on the cell's stdout."""
        msg_id = self.client.execute(code.strip("\n"))  # line 1 is the code's first line
        cell = Cell()
        deadline = time.monotonic() + timeout
        interrupted = interrupt_after is None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.manager.interrupt_kernel()
                raise TimeoutError(f"cell did not finish in {timeout} s: {code[:200]!r}")
            try:
                msg = self.client.get_iopub_msg(timeout=min(left, 1))
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                setattr(cell, content["name"], getattr(cell, content["name"]) + content["text"])
                if not interrupted and interrupt_after in cell.stdout:
                    time.sleep(delay)
                    self.manager.interrupt_kernel()
                    interrupted = True
            elif kind in ("execute_result", "display_data"):
                cell.results.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                cell.error = {"ename": content["ename"], "evalue": content["evalue"],
                              "traceback": _ANSI.sub("", "\n".join(content["traceback"]))}
            elif kind == "status" and content["execution_state"] == "idle":
                break
        self.client.get_shell_msg(timeout=10)  # the execute_reply
        return cell

    def check(self, code: str, **kw) -> Cell:
        """Run a cell that must not raise."""
        cell = self.run(code, **kw)
        assert cell.error is None, cell.error["traceback"]
        return cell

    def clean(self) -> list:
        """What the kernel has left behind (empty when nothing)."""
        return ast.literal_eval(self.check("print(repr(leftovers()))").stdout)

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        yield k
    finally:
        k.close()


@pytest.fixture
def fresh_kernel():
    k = Kernel()
    try:
        yield k
    finally:
        k.close()

