"""Cost of each extra invoke: N invokes in one trace against one plain batched forward.

Model: ``nn.Sequential`` of 24 ``nn.Linear(64, 64)`` (as in bench_core.py), grad enabled, one
intra-op thread. Each invoke's input is ``randn(1, 64)``. For N in (1, 4, 16, 64), in one
process, interleaved in shuffled rounds (see _timing.measure):

    lite_N    one trace with N invokes (the invoke inside a loop), each appending
              model[23].output to a saved list
    plain_N   torch.cat of the N inputs, one forward hook on layer 23 saving its output
              (register, run, remove per call)

Before timing, every N checks that torch.cat of lite_N's outputs equals plain_N's tensor.

Derived, per N: overhead = lite_N - plain_N and overhead / N. Then the least-squares line
overhead = a + b * N over the four N: b is the cost of one more invoke (µs per invoke), with the
residuals and R² as a check that the cost is linear in N.

Target (issue 3): b < 10 µs + the per-module save cost of bench_core.py. That per-module cost is
measured here too, with bench_core's definition ((lite_save_all - lite_save_last) / 23 on a
``randn(8, 64)`` input), so the verdict is self-contained; it is about 4-5 µs on this machine.

Run:

    .venv/bin/python benchmarks/bench_invokes.py            # full run (~30 s)
    .venv/bin/python benchmarks/bench_invokes.py --quick    # smoke run (a few seconds)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _timing import measure, table  # noqa: E402
from nnsight_lite import NNsight, save  # noqa: E402

N_LAYERS, WIDTH = 24, 64
NS = (1, 4, 16, 64)
TARGET_PER_INVOKE_US = 10.0  # plus the per-module cost


def build_cases(net: torch.nn.Sequential, inputs: dict, x8: torch.Tensor) -> dict:
    model = NNsight(net)
    last_layer = net[N_LAYERS - 1]

    def lite(xs):
        with model.trace() as tracer:
            outs = save([])
            for x in xs:
                with tracer.invoke(x):
                    outs.append(model[23].output)
        return outs

    def plain(xs):
        saved = []
        handle = last_layer.register_forward_hook(lambda m, i, o: saved.append(o))
        try:
            net(torch.cat(xs))
        finally:
            handle.remove()
        return saved[0]

    # bench_core's per-module cost, measured in this process for the target
    def lite_save_last():
        with model.trace(x8):
            out = model[23].output.save()
        return out

    def lite_save_all():
        with model.trace(x8):
            hs = save([model[i].output.save() for i in range(24)])
        return hs

    cases = {}
    for n in NS:
        xs = inputs[n]
        cases[f"lite_{n}"] = lambda xs=xs: lite(xs)
        cases[f"plain_{n}"] = lambda xs=xs: plain(xs)
    cases["lite_save_last"] = lite_save_last
    cases["lite_save_all"] = lite_save_all
    return cases


def check(cases: dict, net: torch.nn.Sequential, x8: torch.Tensor) -> None:
    """The compared variants compute the same tensors (else the timings mean nothing)."""
    for n in NS:
        lite, plain = cases[f"lite_{n}"](), cases[f"plain_{n}"]()
        assert len(lite) == n, (n, len(lite))
        assert all(t.shape == (1, WIDTH) for t in lite), [tuple(t.shape) for t in lite]
        assert torch.equal(torch.cat(lite), plain), f"N={n}: invoke outputs differ from plain"
    hs = cases["lite_save_all"]()
    ref = []
    h = x8
    for layer in net:
        h = layer(h)
        ref.append(h)
    assert len(hs) == N_LAYERS and all(map(torch.equal, hs, ref))
    assert torch.equal(cases["lite_save_last"](), ref[-1])


def fit(ns, ys):
    """Least squares y = a + b n: (a, b, residuals, R²)."""
    k = len(ns)
    mn, my = sum(ns) / k, sum(ys) / k
    sxx = sum((n - mn) ** 2 for n in ns)
    sxy = sum((n - mn) * (y - my) for n, y in zip(ns, ys))
    b = sxy / sxx
    a = my - b * mn
    res = [y - (a + b * n) for n, y in zip(ns, ys)]
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum(r * r for r in res) / ss_tot if ss_tot > 0 else float("nan")
    return a, b, res, r2


def summary(m: dict) -> list[str]:
    def verdict(ok):
        return "MET" if ok else "MISSED"

    module_cost = (m["lite_save_all"] - m["lite_save_last"]) / (N_LAYERS - 1)
    target = TARGET_PER_INVOKE_US + module_cost
    over = [m[f"lite_{n}"] - m[f"plain_{n}"] for n in NS]
    a, b, res, r2 = fit(NS, over)
    lines = [f"{'N':>3}  {'lite µs':>9}  {'plain µs':>9}  {'lite/plain':>10}  "
             f"{'overhead µs':>11}  {'per invoke µs':>13}  {'fit resid µs':>12}"]
    for n, o, r in zip(NS, over, res):
        lite, plain = m[f"lite_{n}"], m[f"plain_{n}"]
        lines.append(f"{n:>3}  {lite:9.1f}  {plain:9.1f}  {lite / plain:9.2f}x  "
                     f"{o:11.1f}  {o / n:13.2f}  {r:+12.1f}")
    lines += [
        "",
        f"least-squares fit: overhead = {a:.1f} µs + {b:.2f} µs x N   (R² = {r2:.5f})",
        f"per-module save cost (bench_core definition, measured here): {module_cost:.2f} µs",
        f"slope (cost of one more invoke): {b:8.2f} µs   target: < 10 µs + per-module cost "
        f"(~4-5 µs here; measured: < {target:.2f} µs)  {verdict(b < target)}",
        f"overhead per invoke at N={NS[-1]}:  {over[-1] / NS[-1]:8.2f} µs   (same target)  "
        f"{verdict(over[-1] / NS[-1] < target)}",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few reps: a smoke run for CI")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved calls")
    parser.add_argument("--inner", type=int, help="calls per case per round")
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 30)
    inner = args.inner or (5 if args.quick else 40)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # steadier timings; the model is far too small to gain from threads
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    inputs = {n: [torch.randn(1, WIDTH) for _ in range(n)] for n in NS}
    x8 = torch.randn(8, WIDTH)
    cases = build_cases(net, inputs, x8)
    check(cases, net, x8)

    medians = measure(cases, rounds, inner, warmup=3 if args.quick else 30)
    print(f"nnsight_lite invokes benchmark: {N_LAYERS} x Linear({WIDTH}, {WIDTH}), N invokes of "
          f"randn(1, {WIDTH}), torch {torch.__version__}, 1 thread, "
          f"{rounds * inner} calls per case")
    print("\n".join(table(medians, base="plain_1")))
    print()
    print("\n".join(summary(medians)))


if __name__ == "__main__":
    main()
