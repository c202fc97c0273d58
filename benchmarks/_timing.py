"""Timing helpers shared by every benchmark process (stdlib only: the nnsight peer uses it too).

    Group                    cases measured together, interleaved, and the pairs checked equal
    measure(cases, ...)      {case: {"median", "min", "max", "n", "rounds"}} in µs, interleaved
    over(s, base)            how much slower one measured case is than another, round by round
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
    # the modules the group's read cases read, for benchmarks/on_greenlet.py: {"run": the plain
    # forward, "one": [the one-read case's module], "all": [the all-reads case's modules],
    # "cases": (the hooks' and the library's one-read and all-reads case keys)}
    reads: "dict | None" = None


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
    return {name: stats(ns, inner) for name, ns in samples.items()}


def stats(ns: list, inner: int = 0) -> dict:
    """``{"median", "min", "max", "n"}`` in µs of samples in ns; with ``inner`` (samples per
    round), also ``"rounds"``: each round's median, for differences taken round by round."""
    out = {"median": statistics.median(ns) / 1000, "min": min(ns) / 1000,
           "max": max(ns) / 1000, "n": len(ns)}
    if inner:
        out["rounds"] = [statistics.median(ns[i:i + inner]) / 1000
                         for i in range(0, len(ns), inner)]
    return out


def over(s: "dict | None", base: "dict | None") -> "float | None":
    """How much slower ``s`` is than ``base`` (µs): the median over rounds of the difference
    of their medians in that round, when both were timed in the same rounds. The machine's
    speed drifts over seconds (other processes on its cores), and both cases of one round
    see the same drift; the difference of the overall medians is the fallback."""
    if s is None or base is None:
        return None
    a, b = s.get("rounds"), base.get("rounds")
    if a and b and len(a) == len(b):
        return statistics.median(x - y for x, y in zip(a, b))
    return s["median"] - base["median"]


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
