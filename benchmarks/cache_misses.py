"""Simulated cache misses of a trace against the plain forward, on a SmolLM2-shaped model.

    .venv/bin/python benchmarks/cache_misses.py            # ~3 minutes (valgrind)
    .venv/bin/python benchmarks/cache_misses.py --rounds 3 --python /other/venv/bin/python

A SmolLM2 trace runs about as many instructions as the plain forward, yet costs 1-2 ms more
wall clock (README, Benchmarks). SmolLM2's forward streams its 540 MB of weights through the
last-level cache, so whatever a trace touches that the plain forward does not (the modules'
dicts as the entries go on and off, the entries and slots at each call) comes from memory
again at every trace, at ~100 ns a line. Instruction counts cannot see that; this counts it.

The model here has SmolLM2's shape in modules (30 blocks of 13, 397 in all) with small
layers, and ends in one Linear whose 16 MB of weights stream through a simulated 4 MB
last-level cache (``--LL=4194304,16,64``), as SmolLM2's lm_head streams through this machine's:
a run takes minutes, not the hour SmolLM2 itself takes under valgrind. Cases (each called
three times to warm up, then timed one call at a time between ``os.getppid()`` calls, which
callgrind dumps before): the plain forward, an empty trace, a trace saving the 30 blocks'
outputs. Printed: instructions and last-level misses (instruction and data reads, data writes)
of each trace over the plain forward (the mean of the plain calls around it).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CASES = ("plain", "empty", "save_30")


def _model():
    import torch
    from torch import nn

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(32, 32) for _ in range(4))

        def forward(self, x):
            return self.o(self.q(x) * self.k(x).sigmoid() + self.v(x))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.g, self.u, self.d = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)
            self.act = nn.SiLU()

        def forward(self, x):
            return self.d(self.act(self.g(x)) * self.u(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.attn, self.n2, self.mlp = nn.LayerNorm(32), Attn(), nn.LayerNorm(32), MLP()

        def forward(self, x):
            x = x + self.attn(self.n1(x))
            return x + self.mlp(self.n2(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Linear(8, 32)
            self.layers = nn.ModuleList(Block() for _ in range(30))
            self.norm = nn.LayerNorm(32)
            self.up, self.head = nn.Linear(32, 2048), nn.Linear(2048, 2048)  # 16 MB streamed

        def forward(self, x):
            x = self.emb(x)
            for block in self.layers:
                x = block(x)
            return self.head(self.up(self.norm(x)))

    torch.manual_seed(0)
    return Net().eval()


def child(rounds: int) -> None:
    """Runs under valgrind: one dump per call, in the order printed as ``case`` lines."""
    sys.path.insert(0, str(HERE.parent))
    import torch

    from nnsight_lite import NNsight

    torch.set_num_threads(1)
    net = _model()
    model = NNsight(net)
    x = torch.randn(1, 8)

    def plain():
        return net(x)

    def empty():
        with model.trace(x):
            pass

    def save_30():
        with model.trace(x):
            [model.layers[i].output.save() for i in range(30)]

    calls = {"plain": plain, "empty": empty, "save_30": save_30}
    with torch.no_grad():
        for f in calls.values():
            for _ in range(3):
                f()
        order = ["plain"] + [c for _ in range(rounds) for c in ("empty", "plain", "save_30",
                                                                "plain")]
        for name in order:
            print(f"case {name}", flush=True)
            os.getppid()
            calls[name]()
        os.getppid()


def _events(path: str) -> dict:
    with open(path) as f:
        text = f.read()
    names = re.search(r"^events: (.*)$", text, re.M).group(1).split()
    values = map(int, re.search(r"^summary: (.*)$", text, re.M).group(1).split())
    return dict(zip(names, values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="traces of each kind measured")
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.rounds)
        return
    out = tempfile.mkdtemp(prefix="cachegrind.")
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--LL=4194304,16,64",
           "--dump-before=os_getppid", f"--callgrind-out-file={out}/out", args.python,
           __file__, "--child", "--rounds", str(args.rounds)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    labels = [line[5:] for line in proc.stdout.splitlines() if line.startswith("case ")]
    if proc.returncode != 0 or not labels:
        sys.exit(f"callgrind run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    dumps = sorted(glob.glob(f"{out}/out.*"), key=lambda p: int(p.rsplit(".", 1)[1]))[1:]
    rows = [(label, _events(path)) for label, path in zip(labels, dumps)]
    over = {name: [] for name in CASES[1:]}
    for i, (label, ev) in enumerate(rows):
        if label == "plain":
            continue
        around = [rows[j][1] for j in (i - 1, i + 1) if 0 <= j < len(rows) and rows[j][0] == "plain"]
        base = {k: sum(e[k] for e in around) / len(around) for k in ev}
        over[label].append({k: ev[k] - base[k] for k in ev})
    print("| case | instructions over plain | LL misses over plain (instr + data read + data write) |")
    print("|---|---|---|")
    for name, diffs in over.items():
        for d in diffs:
            misses = d["ILmr"] + d["DLmr"] + d["DLmw"]
            print(f"| {name} | {d['Ir']:+,.0f} | {misses:+,.0f} ({d['ILmr']:+,.0f} / "
                  f"{d['DLmr']:+,.0f} / {d['DLmw']:+,.0f}) |")
    plain = [e for label, e in rows if label == "plain"]
    print(f"\nplain forward: {sum(e['Ir'] for e in plain) / len(plain):,.0f} instructions, "
          f"{sum(e['ILmr'] + e['DLmr'] + e['DLmw'] for e in plain) / len(plain):,.0f} LL misses"
          f" (callgrind dumps in {out})")


if __name__ == "__main__":
    main()
