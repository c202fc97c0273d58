"""The nnsight (upstream) side of bench_core.py: same model, same cases, its own process.

Needs an interpreter with nnsight installed, e.g.::

    python3 -m venv /tmp/nnsight-venv && /tmp/nnsight-venv/bin/pip install torch==2.13.0 nnsight
    /tmp/nnsight-venv/bin/python benchmarks/bench_nnsight_peer.py [--quick] [--json]

bench_core.py ``--peer /tmp/nnsight-venv/bin/python`` runs it with ``--json`` and prints the
numbers beside nnsight_lite's. Cases: plain ``net(x)``, save_last, save_all, edit_all (the
same with-block bodies as bench_core's lite_* cases).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nnsight
import torch
from nnsight import NNsight

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import measure, table  # noqa: E402

N_LAYERS, WIDTH, BATCH = 24, 64, 8


def build_cases(net: torch.nn.Sequential, x: torch.Tensor) -> dict:
    model = NNsight(net)

    def plain():
        return net(x)

    def save_last():
        with model.trace(x):
            out = model[23].output.save()
        return out

    def save_all():
        with model.trace(x):
            hs = nnsight.save([model[i].output.save() for i in range(24)])
        return hs

    def edit_all():
        with model.trace(x):
            for i in range(24):
                model[i].output[:, 0] = 0
            out = model.output.save()
        return out

    return {f.__name__: f for f in (plain, save_last, save_all, edit_all)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few reps: a smoke run")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    args = parser.parse_args()
    rounds, inner = (5, 20) if args.quick else (40, 50)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # as bench_core.py
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    x = torch.randn(BATCH, WIDTH)
    cases = build_cases(net, x)
    assert torch.equal(cases["save_last"](), cases["plain"]())
    assert len(cases["save_all"]()) == N_LAYERS

    medians = measure(cases, rounds, inner, warmup=5 if args.quick else 50)
    if args.json:
        print(json.dumps({"version": nnsight.__version__, "reps": rounds * inner,
                          "medians": medians}))
    else:
        print(f"nnsight {nnsight.__version__}: {N_LAYERS} x Linear({WIDTH}, {WIDTH}), input "
              f"({BATCH}, {WIDTH}), torch {torch.__version__}, 1 thread, "
              f"{rounds * inner} calls per case")
        print("\n".join(table(medians, base="plain")))


if __name__ == "__main__":
    main()
