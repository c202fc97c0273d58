"""Timing helpers shared by bench_core.py and bench_nnsight_peer.py (stdlib only, no torch).

    measure(cases, rounds, inner)   median µs per case, variants interleaved round by round
    table(rows, base)               the printed table: median µs and overhead over ``base``
"""

from __future__ import annotations

import gc
import random
import statistics
import time


def measure(cases: dict, rounds: int, inner: int, warmup: int = 20) -> dict:
    """Median µs of each zero-argument callable in ``cases``.

    Every round runs each case ``inner`` times (each call timed on its own with
    ``perf_counter_ns``), in a fresh shuffled order, so slow drift of the machine hits all cases
    alike. ``rounds * inner`` samples per case in all.
    """
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    samples: dict = {name: [] for name in cases}
    order = list(cases)
    rng = random.Random(0)
    clock = time.perf_counter_ns
    for _ in range(rounds):
        rng.shuffle(order)
        gc.collect()
        for name in order:
            fn, out = cases[name], samples[name]
            for _ in range(inner):
                t0 = clock()
                fn()
                out.append(clock() - t0)
    return {name: statistics.median(ns) / 1000 for name, ns in samples.items()}


def table(medians: dict, base: str, labels: dict | None = None) -> list[str]:
    """Lines of a table: case, median µs, overhead over the ``base`` case in µs."""
    labels = labels or {}
    width = max(len(labels.get(n, n)) for n in medians)
    lines = [f"{'case':<{width}}  {'median µs':>10}  {'over plain µs':>13}"]
    for name, us in medians.items():
        over = "" if name == base else f"{us - medians[base]:+13.1f}"
        lines.append(f"{labels.get(name, name):<{width}}  {us:10.1f}  {over:>13}")
    return lines
