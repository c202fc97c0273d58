"""Cost of reading an activation's gradient with nnsight_lite, and of the Tensor.backward patch.

Model: ``nn.Sequential`` of 24 ``nn.Linear(64, 64)`` (as in bench_core.py), input
``randn(8, 64)``, one intra-op thread. Cases, all in one process, interleaved in shuffled rounds
(see _timing.measure); every case of (a)/(b) starts with ``net.zero_grad(set_to_none=True)``:

    (a) plain       a forward hook on layer 11 calls ``o.retain_grad()`` and keeps ``o``
                    (register, run, remove); ``loss = out.sum()``; backward through the
                    *unpatched* original ``_original_backward(loss)`` (plain PyTorch, nothing of
                    nnsight_lite on the path); returns ``h.grad``
    (a') plain_patched  the same, calling ``loss.backward()`` (the patched method: what a user's
                    plain code runs once nnsight_lite is imported)
    (b) lite        with model.trace(x): hs = model[11].output; loss = model.output.sum();
                    with loss.backward(): g = hs.grad.save()                     returns g
    breakdown of (b) - (a), no target:
    lite_fwd_only   the trace alone: hs = model[11].output; hs.retain_grad(); both hs and
                    loss = model.output.sum() saved; backward after the trace through
                    _original_backward (so (b) - this ~ the cost of the backward context)
    standalone_ctx  (a)'s forward (hook keeps h, no retain_grad), then outside any trace
                    with loss.backward(): g = h.grad.save()
                    (so this - (a) ~ the backward context's cost without a trace)
    (c) bare graph, w = randn(64) a leaf requiring grad, built fresh each call (its ``grad``
        reset to None each call):
        build_only          (w * 2).sum()
        bwd_original        _original_backward((w * 2).sum())
        bwd_patched         (w * 2).sum().backward()
        and on one prebuilt graph kept with retain_graph=True (no build in the timed call):
        retained_original   _original_backward(loss, retain_graph=True)
        retained_patched    loss.backward(retain_graph=True)

Before timing: (a), (a'), (b) and the breakdown cases return identical gradients (and (a), (b)
identical parameter grads), and the (c) pairs give w the same gradient.

Targets (issue 4):  lite / plain < 1.2x;  patched - original < 5 µs per plain backward call
(both the build+backward pair and the retained-graph pair are checked).

Run:

    .venv/bin/python benchmarks/bench_backward.py            # full run (~25 s)
    .venv/bin/python benchmarks/bench_backward.py --quick    # smoke run (a few seconds)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _timing import measure, table  # noqa: E402
from nnsight_lite import NNsight  # noqa: E402
from nnsight_lite.backward import _original_backward  # noqa: E402

N_LAYERS, WIDTH, BATCH = 24, 64, 8
RATIO_TARGET = 1.2
PATCH_TARGET_US = 5.0


def build_cases(net: torch.nn.Sequential, x: torch.Tensor, w: torch.Tensor,
                retained: torch.Tensor) -> dict:
    model = NNsight(net)
    layer11 = net[11]

    def forward_retaining():
        kept = []

        def hook(m, i, o):
            o.retain_grad()
            kept.append(o)

        handle = layer11.register_forward_hook(hook)
        try:
            out = net(x)
        finally:
            handle.remove()
        return kept[0], out

    def plain():
        net.zero_grad(set_to_none=True)
        h, out = forward_retaining()
        loss = out.sum()
        _original_backward(loss)
        return h.grad

    def plain_patched():
        net.zero_grad(set_to_none=True)
        h, out = forward_retaining()
        loss = out.sum()
        loss.backward()
        return h.grad

    def lite():
        net.zero_grad(set_to_none=True)
        with model.trace(x):
            hs = model[11].output
            loss = model.output.sum()
            with loss.backward():
                g = hs.grad.save()
        return g

    def lite_fwd_only():
        net.zero_grad(set_to_none=True)
        with model.trace(x):
            hs = model[11].output
            hs.retain_grad()
            hs = hs.save()
            loss = model.output.sum().save()
        _original_backward(loss)
        return hs.grad

    def standalone_ctx():
        net.zero_grad(set_to_none=True)
        kept = []
        handle = layer11.register_forward_hook(lambda m, i, o: kept.append(o))
        try:
            out = net(x)
        finally:
            handle.remove()
        loss = out.sum()
        h = kept[0]
        with loss.backward():
            g = h.grad.save()
        return g

    def build_only():
        w.grad = None
        return (w * 2).sum()

    def bwd_original():
        w.grad = None
        _original_backward((w * 2).sum())
        return w.grad

    def bwd_patched():
        w.grad = None
        (w * 2).sum().backward()
        return w.grad

    def retained_original():
        w.grad = None
        _original_backward(retained, retain_graph=True)
        return w.grad

    def retained_patched():
        w.grad = None
        retained.backward(retain_graph=True)
        return w.grad

    return {f.__name__: f for f in (plain, plain_patched, lite, lite_fwd_only, standalone_ctx,
                                    build_only, bwd_original,
                                    bwd_patched, retained_original, retained_patched)}


def check(cases: dict, net: torch.nn.Sequential) -> None:
    """The compared variants compute the same tensors (else the timings mean nothing)."""
    g_plain = cases["plain"]()
    grads_plain = [p.grad.clone() for p in net.parameters()]
    g_patched = cases["plain_patched"]()
    g_lite = cases["lite"]()
    grads_lite = [p.grad.clone() for p in net.parameters()]
    assert g_plain is not None and g_plain.shape == (BATCH, WIDTH)
    assert torch.equal(g_plain, g_patched), "plain_patched gradient differs from plain"
    assert torch.equal(g_plain, g_lite), "nnsight_lite hs.grad differs from plain retain_grad"
    assert all(map(torch.equal, grads_plain, grads_lite)), "parameter grads differ"
    for name in ("lite_fwd_only", "standalone_ctx"):
        assert torch.equal(g_plain, cases[name]()), f"{name} gradient differs from plain"
    for a, b in (("bwd_original", "bwd_patched"), ("retained_original", "retained_patched")):
        ga, gb = cases[a]().clone(), cases[b]().clone()
        assert torch.equal(ga, gb) and torch.equal(ga, torch.full_like(ga, 2.0)), (a, b)


def summary(m: dict) -> list[str]:
    def verdict(ok):
        return "MET" if ok else "MISSED"

    ratio = m["lite"] / m["plain"]
    patch_build = m["bwd_patched"] - m["bwd_original"]
    patch_retained = m["retained_patched"] - m["retained_original"]
    return [
        f"(b) lite / (a) plain:            {ratio:6.3f}x  ({m['lite'] - m['plain']:+.1f} µs)   "
        f"target < {RATIO_TARGET}x  {verdict(ratio < RATIO_TARGET)}",
        f"(a') plain with patched .backward() - (a): {m['plain_patched'] - m['plain']:+.1f} µs",
        f"    breakdown: trace alone (lite_fwd_only - plain): "
        f"{m['lite_fwd_only'] - m['plain']:+.1f} µs; backward context in the trace "
        f"(lite - lite_fwd_only): {m['lite'] - m['lite_fwd_only']:+.1f} µs; backward context "
        f"standalone (standalone_ctx - plain): {m['standalone_ctx'] - m['plain']:+.1f} µs",
        f"(c) patch cost, build+backward:   {patch_build:+6.2f} µs per call   "
        f"target < {PATCH_TARGET_US:.0f} µs  {verdict(patch_build < PATCH_TARGET_US)}",
        f"(c) patch cost, retained graph:   {patch_retained:+6.2f} µs per call   "
        f"target < {PATCH_TARGET_US:.0f} µs  {verdict(patch_retained < PATCH_TARGET_US)}",
        f"    (graph build alone: {m['build_only']:.1f} µs; original backward on it: "
        f"{m['bwd_original'] - m['build_only']:.1f} µs)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few reps: a smoke run for CI")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved calls")
    parser.add_argument("--inner", type=int, help="calls per case per round")
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 40)
    inner = args.inner or (10 if args.quick else 50)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # steadier timings; the model is far too small to gain from threads
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    x = torch.randn(BATCH, WIDTH)
    w = torch.randn(WIDTH, requires_grad=True)
    retained = (w * 2).sum()
    cases = build_cases(net, x, w, retained)
    check(cases, net)

    medians = measure(cases, rounds, inner, warmup=5 if args.quick else 50)
    print(f"nnsight_lite backward benchmark: {N_LAYERS} x Linear({WIDTH}, {WIDTH}), input "
          f"({BATCH}, {WIDTH}), torch {torch.__version__}, 1 thread, "
          f"{rounds * inner} calls per case")
    print("\n".join(table(medians, base="plain")))
    print()
    print("\n".join(summary(medians)))


if __name__ == "__main__":
    main()
