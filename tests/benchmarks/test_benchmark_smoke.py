"""The benchmark command runs, checks its cases against bare hooks and prints the table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_ok(*args) -> str:
    """Run ``python *args`` from the repository root; its stdout, once it has exited 0."""
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_quick_benchmark_prints_the_table():
    """`python -m benchmarks --quick` (rows 1, 2 and 7) exits 0 after checking every
    nnsight_lite case equal to the same work done with bare PyTorch hooks, and prints the table
    rows and the targets."""
    out = run_ok("-m", "benchmarks", "--quick", "--only", "linear,gpt2,cold")
    for row in ("save all 24 outputs", "zero all 12 MLP outputs", "64 invoke(s)",
                "first trace at a new call site"):
        assert row in out, out
    assert "fixed cost of a trace" in out and "one more invoke" in out, out


def test_instruction_count_cases_run_between_their_markers():
    """`benchmarks/instructions.py --child` (what runs under callgrind) builds the groups and
    runs each case it is asked for between its two dump markers, naming it on stdout."""
    out = run_ok("benchmarks/instructions.py", "--child", "--only", "linear", "--cases",
                 "plain,lib.save_last", "--calls", "2")
    assert out.split() == ["case", "linear/plain", "case", "linear/lib.save_last"]


def test_forward_on_greenlets_runs_and_checks_the_results():
    """`benchmarks/on_greenlet.py` runs the plain forward on main, on bare greenlets and on
    nnsight_lite's runner worker, checks the results equal before timing, and prints a row
    for each way and the group's one-read trace; then, after checking that the bare greenlet
    design reads the same tensors as the hooks, a row of per-read costs and switch times."""
    out = run_ok("benchmarks/on_greenlet.py", "--only", "linear", "--rounds", "2", "--inner", "2")
    forwards, reads = out.split("\n\n")
    rows = [line for line in forwards.splitlines() if line.startswith("| linear |")]
    ways = [r.split("|")[2].strip() for r in rows]
    assert ways == ["main", "greenlet", "greenlet 128 KiB down", "nnsight_lite runner",
                    "trace: lib.save_last"], out
    rows = [line.split("|")[2:-1] for line in reads.splitlines()
            if line.startswith("| linear |")]
    assert len(rows) == 1 and len(rows[0]) == 4, out
    hot, cold = rows[0][3].split("/")
    assert float(hot) > 0 and float(cold) > 0, out


def test_phases_runs_and_checks_the_results():
    """`benchmarks/phases.py` checks a trace's values against the plain forward and hooks,
    then prints one row per phase of a trace, the trace against the plain forward, and the
    hot / after-a-forward times of a few trivial steps; its timers come off at the end."""
    out = run_ok("benchmarks/phases.py", "--only", "gpt2", "--rounds", "1")
    for row in ("| entries and wrappers on |", "| the forward |", "| whole trace - plain forward |",
                "| an empty call |"):
        assert row in out, out
