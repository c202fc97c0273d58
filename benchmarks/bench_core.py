"""Per-trace and per-module overhead of nnsight_lite against plain PyTorch forward hooks.

Model: ``nn.Sequential`` of 24 ``nn.Linear(64, 64)``, input ``randn(8, 64)``, grad enabled (as a
user would run it), one intra-op thread (at this size a second thread only adds noise).
Cases, all measured in one process:

    plain             net(x)                                   (plain_nograd: under no_grad)
    hook_save_last    one forward hook on layer 23 saving its output (register, run, remove)
    hook_save_all     hooks on all 24 layers saving their outputs
    hook_edit_all     hooks on all 24 layers doing ``out[:, 0] = 0`` in place
    lite_save_last    with model.trace(x): out = model[23].output.save()
    lite_save_all     with model.trace(x): hs = [model[i].output.save() for i in range(24)]
    lite_edit_all     with model.trace(x): for i in range(24): model[i].output[:, 0] = 0

Each case's median over >= 2000 calls (each call timed with perf_counter_ns, after a warm-up;
the cases are interleaved in shuffled rounds so machine noise hits all of them alike). Derived:

    fixed overhead per trace   lite_save_last - plain                  target < 60 µs
    per-module cost            (lite_save_all - lite_save_last) / 23   target < 2x the bare hook's
                               (hook_save_all - hook_save_last) / 23

Run:

    .venv/bin/python benchmarks/bench_core.py                     # full run (~30 s)
    .venv/bin/python benchmarks/bench_core.py --quick             # smoke run (a few seconds)
    .venv/bin/python benchmarks/bench_core.py --peer /tmp/nnsight-venv/bin/python

``--peer PYTHON`` also runs bench_nnsight_peer.py under that interpreter (one with nnsight
installed) and prints its numbers beside ours. This script never imports nnsight.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _timing import measure, table  # noqa: E402
from nnsight_lite import NNsight, save  # noqa: E402

N_LAYERS, WIDTH, BATCH = 24, 64, 8
FIXED_TARGET_US = 60.0
PER_MODULE_TARGET_RATIO = 2.0


def build_cases(net: torch.nn.Sequential, x: torch.Tensor) -> dict:
    model = NNsight(net)
    layers = list(net)
    last = N_LAYERS - 1

    def plain():
        return net(x)

    def plain_nograd():
        with torch.no_grad():
            return net(x)

    def with_hooks(mods, hook):
        handles = [m.register_forward_hook(hook) for m in mods]
        try:
            return net(x)
        finally:
            for h in handles:
                h.remove()

    def hook_save_last():
        saved = []
        with_hooks([layers[last]], lambda m, i, o: saved.append(o))
        return saved

    def hook_save_all():
        saved = []
        with_hooks(layers, lambda m, i, o: saved.append(o))
        return saved

    def hook_edit_all():
        def edit(m, i, o):
            o[:, 0] = 0

        return with_hooks(layers, edit)

    def lite_save_last():
        with model.trace(x):
            out = model[23].output.save()
        return out

    def lite_save_all():
        # save() on the list too: only names bound to saved objects come back after the trace
        with model.trace(x):
            hs = save([model[i].output.save() for i in range(24)])
        return hs

    def lite_edit_all():
        with model.trace(x):
            for i in range(24):
                model[i].output[:, 0] = 0
            out = model.output.save()
        return out

    return {f.__name__: f for f in (plain, plain_nograd, hook_save_last, hook_save_all,
                                    hook_edit_all, lite_save_last, lite_save_all, lite_edit_all)}


def check(cases: dict) -> None:
    """The compared variants compute the same thing (else the timings mean nothing)."""
    assert torch.equal(cases["lite_save_last"](), cases["plain"]())
    lite, hook = cases["lite_save_all"](), cases["hook_save_all"]()
    assert len(lite) == len(hook) == N_LAYERS and all(map(torch.equal, lite, hook))
    assert torch.equal(cases["lite_edit_all"](), cases["hook_edit_all"]())


def summary(m: dict) -> list[str]:
    fixed = m["lite_save_last"] - m["plain"]
    fixed_hook = m["lite_save_last"] - m["hook_save_last"]
    lite_mod = (m["lite_save_all"] - m["lite_save_last"]) / (N_LAYERS - 1)
    hook_mod = (m["hook_save_all"] - m["hook_save_last"]) / (N_LAYERS - 1)
    lite_edit = (m["lite_edit_all"] - m["lite_save_last"]) / (N_LAYERS - 1)
    hook_edit = (m["hook_edit_all"] - m["hook_save_last"]) / (N_LAYERS - 1)
    ratio = lite_mod / hook_mod if hook_mod > 0 else float("inf")

    def verdict(ok):
        return "MET" if ok else "MISSED"

    return [
        f"fixed overhead per trace (lite_save_last - plain): {fixed:8.1f} µs   "
        f"target < {FIXED_TARGET_US:.0f} µs  {verdict(fixed < FIXED_TARGET_US)}",
        f"  of which beyond one bare hook (- hook_save_last): {fixed_hook:7.1f} µs",
        f"per-module save cost, nnsight_lite:  {lite_mod:8.2f} µs",
        f"per-module save cost, bare hook:     {hook_mod:8.2f} µs",
        f"  ratio lite / hook:                 {ratio:8.2f} x   "
        f"target < {PER_MODULE_TARGET_RATIO:.0f}x  {verdict(ratio < PER_MODULE_TARGET_RATIO)}",
        f"per-module edit cost (approx., vs *_save_last): lite {lite_edit:.2f} µs, "
        f"hook {hook_edit:.2f} µs",
    ]


def run_peer(python: str, quick: bool) -> dict | None:
    cmd = [python, str(HERE / "bench_nnsight_peer.py"), "--json"] + (["--quick"] if quick else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"\npeer run failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def side_by_side(ours: dict, peer: dict) -> list[str]:
    pairs = [("plain", "plain"), ("lite_save_last", "save_last"),
             ("lite_save_all", "save_all"), ("lite_edit_all", "edit_all")]
    lines = [f"{'case':<10}  {'lite µs':>9}  {'lite over':>9}  {'nnsight µs':>10}  "
             f"{'nns over':>9}  {'nnsight/lite':>12}"]
    for mine, theirs in pairs:
        a, b = ours[mine], peer["medians"].get(theirs)
        if b is None:
            continue
        over_a, over_b = a - ours["plain"], b - peer["medians"]["plain"]
        lines.append(f"{theirs:<10}  {a:9.1f}  {over_a:9.1f}  {b:10.1f}  {over_b:9.1f}  "
                     f"{b / a:11.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few reps: a smoke run for CI")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved calls")
    parser.add_argument("--inner", type=int, help="calls per case per round")
    parser.add_argument("--peer", metavar="PYTHON", help="interpreter with nnsight installed")
    args = parser.parse_args()
    rounds = args.rounds or (5 if args.quick else 40)
    inner = args.inner or (20 if args.quick else 50)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # steadier timings; the model is far too small to gain from threads
    net = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(N_LAYERS)])
    x = torch.randn(BATCH, WIDTH)
    cases = build_cases(net, x)
    check(cases)

    medians = measure(cases, rounds, inner, warmup=5 if args.quick else 50)
    print(f"nnsight_lite core benchmark: {N_LAYERS} x Linear({WIDTH}, {WIDTH}), input "
          f"({BATCH}, {WIDTH}), torch {torch.__version__}, 1 thread, "
          f"{rounds * inner} calls per case")
    print("\n".join(table(medians, base="plain")))
    print()
    print("\n".join(summary(medians)))

    if args.peer:
        peer = run_peer(args.peer, args.quick)
        if peer is not None:
            print(f"\nbeside nnsight {peer['version']} (separate process, {peer['reps']} calls "
                  f"per case; 'over' = minus that process's own plain forward):")
            print("\n".join(side_by_side(medians, peer)))


if __name__ == "__main__":
    main()
