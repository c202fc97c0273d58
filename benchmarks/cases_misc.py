"""Rows 6 and 7 of the benchmark table: memory, and the first trace at a new call site.

These are not interleaved timings: each returns a :class:`Group` with a ``runner`` that
measures in its own way and returns ``{key: {"median", "min", "max", "n"}}``.
"""

from __future__ import annotations

import gc
import importlib.util
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _timing import Group, same, stats
from cases import BATCH, N_LAYERS, WIDTH, PROMPT, tiny_gpt2, tokenizer

COLD_SOURCE = '''
def run(model, x):
    with model.trace(x):
        out = model[23].output.save()
    return out
'''


def cold_start(lib, scale: int = 1) -> Group:
    """Row 7: the first trace at a call site (finding, checking and compiling its body) against
    the second and later ones there. Each repetition imports a fresh module file."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    x = torch.randn(BATCH, WIDTH)
    model = lib.NNsight(net)
    reps = 25 if scale else 5

    def runner():
        cold, warm = [], []
        expected = net(x)
        with tempfile.TemporaryDirectory() as tmp:
            for k in range(reps):
                path = Path(tmp) / f"bench_cold_{k}.py"
                path.write_text(COLD_SOURCE)
                spec = importlib.util.spec_from_file_location(path.stem, path)
                mod = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(mod)
                gc.collect()
                t0 = time.perf_counter_ns()
                out = mod.run(model, x)
                cold.append(time.perf_counter_ns() - t0)
                assert same(out, expected), "cold trace result differs from the plain forward"
                for _ in range(3):
                    t0 = time.perf_counter_ns()
                    mod.run(model, x)
                    warm.append(time.perf_counter_ns() - t0)
                sys.modules.pop(path.stem, None)
        return {"lib.warm": stats(warm), "lib.cold": stats(cold)}

    return Group("cold", {}, runner=runner)


# --------------------------------------------------------------------------- memory


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in kB (0 where there is no /proc)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
        return True
    except OSError:
        return False


def _live_tensors() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor or type(o) is
               torch.nn.Parameter)


def _exact_rss() -> None:
    """Make glibc map every allocation of 64 kB or more on its own and unmap it when freed, so
    the resident set follows the live tensors (by default freed memory stays mapped)."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (fixed: no dynamic raising)
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def memory(lib, path=None, scale: int = 1) -> Group:
    """Row 6: (a) what 1,000 traces that each save one activation (dropped at once) leave
    behind: resident memory, Python heap (tracemalloc), live tensors; (b) the peak resident
    memory of a forward (grad enabled) with a trace that saves nothing against without, on
    SmolLM2 with a 64-token prompt (the tiny GPT-2 with a 16 x 64 batch where SmolLM2 is missing).
    """
    import tracemalloc

    hf = tiny_gpt2()
    tok = tokenizer()
    model = lib.LanguageModel(hf, tokenizer=tok)
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    if path is not None:
        from transformers import AutoModelForCausalLM

        big = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        big_ids = torch.arange(64).unsqueeze(0) + 100
    else:
        big, big_ids = tiny_gpt2(), torch.randint(0, 30, (16, 64))
    big_model = lib.LanguageModel(big, tokenizer=tok)
    n_traces = 1000 if scale else 200

    def one_trace():
        with model.trace(ids):
            h = model.transformer.h[5].output.save()
        return h

    def peak(fn) -> int:
        gc.collect()
        base = _status("VmRSS")
        _reset_peak()
        fn()
        return _status("VmHWM") - base

    def big_plain():
        return big(big_ids).logits

    def big_trace():
        with big_model.trace(big_ids):
            shape = big_model.lm_head.output.shape  # read, not saved
        return None

    def runner():
        def window():
            for _ in range(n_traces):
                one_trace()
            gc.collect()

        window()  # warm-up: the first traces fill caches once
        rss0, tensors0 = _status("VmRSS"), _live_tensors()
        window()
        rss1, tensors1 = _status("VmRSS"), _live_tensors()
        # the heap in a window of its own, after a warm-up under tracemalloc: each trace puts a
        # forward in and out of every module's __dict__, so the first traces under tracemalloc
        # reallocate those dicts (at the same size) from untracked to tracked memory, which
        # would read as ~200 kB "grown"; and tracemalloc's bookkeeping is resident memory
        tracemalloc.start()
        window()
        heap0 = tracemalloc.get_traced_memory()[0]
        window()
        heap1 = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        out = {"retained_rss_kb": rss1 - rss0, "retained_heap_kb": (heap1 - heap0) / 1024,
               "retained_tensors": tensors1 - tensors0}
        _exact_rss()
        if _reset_peak():
            plain, traced = [], []
            for _ in range(6 if scale else 2):
                plain.append(peak(big_plain))
                traced.append(peak(big_trace))
            out["peak_plain_kb"] = statistics.median(plain)
            out["peak_trace_kb"] = statistics.median(traced)
        return {"memory": out}

    return Group("memory", {}, runner=runner)
