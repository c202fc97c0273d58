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

A second table prices one read (a module's output handed to a body) three ways: a bare PyTorch
forward hook; the least any greenlet design can do (a pooled body greenlet, started below the
forward's stack as nnsight_lite's are, that asks for each output in turn, and a forward hook
that switches into it and back); and nnsight_lite's trace. Each per-read cost is the all-reads
case over the one-read case, divided by the extra reads. Last, one greenlet switch pair
(there and back) is timed hot, in a tight loop, and once right after the group's forward, as
every switch in a trace is: what the forward leaves in the caches and branch predictors
decides what a switch costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import greenlet  # noqa: E402
import torch  # noqa: E402

from benchmarks._timing import measure, over, same  # noqa: E402
from benchmarks.run import build, load_lib  # noqa: E402
from cases import with_hooks  # noqa: E402  (benchmarks/ is on the path: benchmarks.run)


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


class Reader:
    """The least a greenlet design does per read, with nothing of nnsight_lite's but where its
    body starts: one pooled body greenlet, started below a 128 KiB descent as nnsight_lite's
    body workers are, reads the outputs it is given a list of, in order; a forward hook on each
    of those modules switches into it when it is the one the body waits for."""

    def __init__(self):
        from nnsight_lite import workers

        main = greenlet.getcurrent()

        def body():
            job = main.switch()
            while True:
                saved, count = job
                for i in range(count):
                    saved.append(main.switch(i))  # ask for read i, get the output
                job = main.switch(None)  # done: nothing more to wait for

        def nursery():  # (starts the body down there, so the body's stack is its own frames)
            main.switch()
            while True:
                main.switch(greenlet.greenlet(body, main))

        self.nursery = greenlet.greenlet(workers._below(nursery))
        self.nursery.switch()
        self.body = self.nursery.switch()
        self.body.switch()
        self.waiting = None  # the index of the read the body waits for (None: none)

    def reads(self, run, modules):
        """``run()`` with the body reading the outputs of ``modules`` in turn; what it read."""
        saved = []
        index = {m: i for i, m in enumerate(modules)}

        def hook(module, args, out):
            if self.waiting == index[module]:
                self.waiting = self.body.switch(out)

        self.waiting = self.body.switch((saved, len(modules)))
        with_hooks(run, modules, hook)
        if self.waiting is not None:
            raise AssertionError(f"the body still waits for read {self.waiting}")
        return saved

    def switch_pair(self):
        """One switch into the body and back (it asks for nothing)."""
        self.body.switch(([], 0))


def per_read(group, rounds: int, inner: int, reader: Reader) -> dict:
    """µs per read beyond the first: bare hooks, the bare greenlet design, nnsight_lite."""
    r = group.reads
    hooks_one, hooks_all, lib_one, lib_all = r["cases"]
    run, one, every = r["run"], r["one"], r["all"]
    cases = {"plain": run, "hooks one": group.cases[hooks_one],
             "hooks all": group.cases[hooks_all],
             "greenlet one": lambda: reader.reads(run, one),
             "greenlet all": lambda: reader.reads(run, every),
             "lib one": group.cases[lib_one], "lib all": group.cases[lib_all]}
    for n in ("one", "all"):  # every way reads the same tensors, checked before timing
        want = cases[f"hooks {n}"]()
        for way in ("greenlet", "lib"):
            got = cases[f"{way} {n}"]()
            if way == "greenlet" and n == "one":  # (the one-read cases give the tensor alone)
                got = got[0]
            if not same(got, want):
                raise AssertionError(f"{group.name}: {way} {n} read other values than the hooks")
    stats = measure(cases, rounds, inner)
    extra = len(every) - len(one)
    return {way: over(stats[f"{way} all"], stats[f"{way} one"]) / extra
            for way in ("hooks", "greenlet", "lib")}


def switch_costs(run, reader: Reader, n: int = 300) -> tuple:
    """Median ns of one switch pair into the body and back: hot (in a tight loop), and right
    after ``run()`` (the group's forward)."""
    clock = time.perf_counter_ns
    hot, cold = [], []
    for _ in range(n):
        t0 = clock()
        reader.switch_pair()
        hot.append(clock() - t0)
    for _ in range(n):
        run()
        t0 = clock()
        reader.switch_pair()
        cold.append(clock() - t0)
    return statistics.median(hot), statistics.median(cold)


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
    groups = {name: build(lib, name, 1, None) for name in args.only.split(",")}
    for name, group in groups.items():
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

    reader = Reader()
    print()
    print("| group | per read: bare hook µs | bare greenlet design µs | nnsight_lite µs "
          "| switch pair: hot / after the forward ns |")
    print("|---|---|---|---|---|")
    for name, group in groups.items():
        if group.reads is None:
            continue
        got = per_read(group, args.rounds, args.inner, reader)
        hot, cold = switch_costs(group.reads["run"], reader)
        print(f"| {name} | {got['hooks']:.2f} | {got['greenlet']:.2f} | {got['lib']:.2f} "
              f"| {hot:.0f} / {cold:.0f} |")


if __name__ == "__main__":
    main()
