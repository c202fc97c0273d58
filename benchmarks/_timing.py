"""Timing helpers shared by every benchmark process (stdlib only: the nnsight peer uses it too).

    Group                    cases measured together, interleaved, and the pairs checked equal
    measure(cases, ...)      {case: {"median", "min", "max", "n"}} in µs, variants interleaved
    same(a, b)               whether two results (tensors, lists, tuples, dicts) are equal
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass
class Group:
    """Cases timed in one interleaved run; ``checks`` pairs whose results must be equal."""

    name: str
    cases: dict
    checks: list = field(default_factory=list)
    rounds: int = 30
    inner: int = 20
    warmup: int = 20
    runner: "Callable | None" = None  # a custom measurement (cold start, memory) instead


def measure(cases: dict, rounds: int, inner: int, warmup: int = 20) -> dict:
    """Median, min and max µs of each zero-argument callable in ``cases``.

    Every round runs each case ``inner`` times (each call timed on its own with
    ``perf_counter_ns``), in a fresh shuffled order, so slow drift of the machine hits all cases
    alike. ``rounds * inner`` samples per case in all. The garbage collector stays on (as a
    user has it) and also runs between rounds, so no case inherits another's garbage.
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
    return {name: stats(ns) for name, ns in samples.items()}


def stats(ns: list) -> dict:
    """``{"median", "min", "max", "n"}`` in µs of samples in ns."""
    return {"median": statistics.median(ns) / 1000, "min": min(ns) / 1000,
            "max": max(ns) / 1000, "n": len(ns)}


def same(a, b) -> bool:
    """Whether two benchmark results are equal: tensors exactly (``torch.equal``), containers
    element by element, anything else with ``==``."""
    if hasattr(a, "shape") and hasattr(b, "shape"):
        import torch

        return a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b
