"""What running a forward on a greenlet costs by itself, with no trace at all.

    python benchmarks/on_greenlet.py [--only linear,gpt2] [--rounds 20]

nnsight_lite runs a model's forward on a pooled worker greenlet (see README, How it works).
This times the plain forward of each benchmark group four ways in one process, interleaved
(benchmarks/_timing.py): on the main greenlet; on a bare greenlet started where the caller
is; on a bare greenlet started 128 KiB further down the stack; and on nnsight_lite's own
runner worker (a job handed to it as a trace's ``_drive`` hands the forward); and, for scale,
the group's one-read trace. Instruction counts
cannot see this cost: the instructions are the same, only where the stack and the frames lie
in memory differs. It is part of the wall-clock overhead of every trace, and moves with the
model and the stack position (1-7% of a 24 x Linear(64) forward here).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import greenlet  # noqa: E402
import torch  # noqa: E402

from benchmarks._timing import measure, over, same  # noqa: E402
from benchmarks.run import build, load_lib  # noqa: E402


def _looping(fn):
    """A greenlet body that runs ``fn`` at every switch into it and switches its result back."""

    def main():
        parent = greenlet.getcurrent().parent
        while True:
            parent.switch(fn())

    return main


def ways(plain) -> dict:
    """The plain forward as zero-argument callables: on main, on greenlets, on a runner."""
    from nnsight_lite import workers

    level = greenlet.greenlet(_looping(plain))
    deep = greenlet.greenlet(workers._below(_looping(plain)))  # (the bodies' descent: 128 KiB)
    box = []

    def job():
        box.append(plain())

    def on_runner():  # (as Tracer._drive runs a forward: a pooled worker, one job)
        worker = workers._take_worker(workers.RUNNER)
        workers.switch_job(worker, job)  # (returns once the job has ended)
        return box.pop()

    return {"main": plain, "greenlet": level.switch, "greenlet 128 KiB down": deep.switch,
            "nnsight_lite runner": on_runner}


#: each group's one-read trace, timed beside the plain forwards
TRACES = {"linear": "lib.save_last", "gpt2": "lib.save_one", "grads": "lib.grad_1"}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="linear,gpt2")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--inner", type=int, default=20)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lib = load_lib("nnsight_lite")
    print("| group | way | median µs | over main µs | ÷ main |")
    print("|---|---|---|---|---|")
    for name in args.only.split(","):
        group = build(lib, name, 1, None)
        cases = ways(group.cases["plain"])
        want = cases["main"]()
        for way, fn in cases.items():  # the same forward every way, checked before timing
            if not same(fn(), want):
                raise AssertionError(f"{name}: the forward run on {way} gave another result")
        trace = TRACES.get(name)
        if trace in group.cases:  # the smallest trace of the group, for scale
            cases[f"trace: {trace}"] = group.cases[trace]
        stats = measure(cases, args.rounds, args.inner)
        base = stats["main"]["median"]
        for way, s in stats.items():
            extra = over(s, stats["main"]) if way != "main" else 0.0
            print(f"| {name} | {way} | {s['median']:.1f} | {extra:+.1f} | "
                  f"{s['median'] / base:.3f}x |")


if __name__ == "__main__":
    main()
