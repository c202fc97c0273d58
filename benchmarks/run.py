"""One benchmark table: nnsight_lite against bare PyTorch hooks and (optionally) nnsight.

Run from the repository root::

    .venv/bin/python -m benchmarks                          # full run (~5 minutes)
    .venv/bin/python -m benchmarks --quick                  # smoke run (~30 s)
    .venv/bin/python -m benchmarks --peer /tmp/nnv/bin/python   # nnsight 0.8 beside it
    .venv/bin/python -m benchmarks --only linear,gpt2       # some groups only

Groups (rows of the issue): ``linear`` (1), ``gpt2`` (2), ``grads`` (3), ``generate`` (4),
``smollm2`` (5; skipped when the weights are not installed), ``memory`` (6), ``cold`` (7).
Within a group every case (plain forward, bare hooks, the library) runs in one process,
interleaved in shuffled rounds (``_timing.measure``); each case's result is checked equal to
the bare hooks' (or the plain forward's) before anything is timed. One intra-op thread.

``--peer PYTHON`` runs this same file under an interpreter that has nnsight installed
(``--lib nnsight``: the same case code with ``nnsight`` imported in place of ``nnsight_lite``)
in a subprocess, and puts its numbers beside ours; its overheads are taken over its own
process's plain forward. This process never imports nnsight.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import torch  # noqa: E402

from _timing import measure, same  # noqa: E402

GROUPS = ("linear", "gpt2", "grads", "generate", "smollm2", "memory", "cold")


def load_lib(name: str):
    """The library under test as a namespace: NNsight, LanguageModel, save (+ extras)."""
    if name == "nnsight":
        import nnsight

        return types.SimpleNamespace(NNsight=nnsight.NNsight, LanguageModel=nnsight.LanguageModel,
                                     save=nnsight.save, version=nnsight.__version__)
    import nnsight_lite
    from nnsight_lite.backward import _original_backward

    return types.SimpleNamespace(NNsight=nnsight_lite.NNsight,
                                 LanguageModel=nnsight_lite.LanguageModel, save=nnsight_lite.save,
                                 unpatched_backward=_original_backward,
                                 install_probe=_install_probe, version=_lite_version())


def _lite_version() -> str:
    try:
        from importlib.metadata import version

        return version("nnsight_lite")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        return "checkout"


def _install_probe(model):
    """A call that puts nnsight_lite's counting wrappers on ``model`` and takes them off (what
    a trace does around its forward), for the SmolLM2 row."""
    from nnsight_lite.interleaver import Interleaver

    def install():
        inter = Interleaver(model._module, 1, model.__dict__)
        inter._install()
        inter._uninstall()

    return install


def smollm2_path():
    """The local SmolLM2 directory, or None where the weights are not installed."""
    try:
        from nnsight_lite.models import smollm2_path as find

        return str(find())
    except (ImportError, OSError):
        return None


def build(lib, name: str, scale: int, path):
    import cases
    import cases_lm
    import cases_misc

    if name == "linear":
        return cases.linear_stack(lib, scale)
    if name == "gpt2":
        return cases.gpt2(lib, scale)
    if name == "grads":
        return cases.grads(lib, scale)
    if name == "generate":
        return cases_lm.generation(lib, scale)
    if name == "smollm2":
        return cases_lm.smollm2(lib, path, scale)
    if name == "memory":
        return cases_misc.memory(lib, path, scale)
    return cases_misc.cold_start(lib, scale)


def check(group, strict: bool) -> dict:
    """Run each checked pair once; return ``{case: reason}`` for those that failed (raise if
    ``strict``)."""
    failed = {}
    for a, b in group.checks:
        try:
            ok = same(group.cases[a](), group.cases[b]())
            reason = None if ok else "result differs"
        except Exception as exc:  # noqa: BLE001 - reported (peer) or re-raised (strict)
            if strict:
                raise
            ok, reason = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        if not ok:
            if strict:
                raise AssertionError(f"{group.name}: {a} does not equal {b}")
            failed[f"{group.name}/{a}"] = reason
            group.cases.pop(a, None)
    return failed


def run_groups(lib_name: str, names, quick: bool, path, peer_mode: bool,
               log=print) -> dict:
    """Measure ``names`` with one library; return ``{"groups": {...}, "failed": {...}}``."""
    lib = load_lib(lib_name)
    scale = 0 if quick else 1
    results, failed = {}, {}
    for name in names:
        if name in ("smollm2",) and path is None:
            continue
        t0 = time.time()
        try:
            group = build(lib, name, scale, path)
        except Exception as exc:  # noqa: BLE001
            if not peer_mode:
                raise
            failed[name] = f"{type(exc).__name__}: {exc}"
            continue
        if group.runner is not None:
            try:
                results[name] = group.runner()
            except Exception as exc:  # noqa: BLE001
                if not peer_mode:
                    raise
                failed[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            log(f"  {lib_name} {name}: {time.time() - t0:.1f} s")
            continue
        failed.update(check(group, strict=not peer_mode))
        cases = group.cases
        if peer_mode:  # the peer needs its own plain forward and its library's cases only
            cases = {k: v for k, v in cases.items() if not k.startswith("hooks.")}
        if quick:
            rounds, inner, warmup = 3, max(1, group.inner // 4), max(1, group.warmup // 5)
        else:
            rounds, inner, warmup = group.rounds, group.inner, group.warmup
        results[name] = measure(cases, rounds, inner, warmup)
        log(f"  {lib_name} {name}: {time.time() - t0:.1f} s")
    return {"version": lib.version, "groups": results, "failed": failed}


def run_peer(python: str, names, quick: bool, path) -> dict | None:
    cmd = [python, str(Path(__file__).resolve()), "--lib", "nnsight", "--json",
           "--only", ",".join(names)] + (["--quick"] if quick else [])
    if path:
        cmd += ["--smollm2", path]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(HERE.parent))
    if proc.returncode != 0:
        print(f"peer run failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def main(argv=None) -> None:
    from report import render

    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few reps: a smoke run")
    parser.add_argument("--only", help=f"comma-separated groups of {', '.join(GROUPS)}")
    parser.add_argument("--peer", metavar="PYTHON", help="an interpreter with nnsight installed")
    parser.add_argument("--lib", default="nnsight_lite", choices=["nnsight_lite", "nnsight"],
                        help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead")
    parser.add_argument("--smollm2", metavar="DIR", help="SmolLM2 directory (default: found)")
    args = parser.parse_args(argv)
    names = [n for n in (args.only.split(",") if args.only else GROUPS)]
    unknown = set(names) - set(GROUPS)
    if unknown:
        parser.error(f"unknown group(s) {sorted(unknown)}; choose from {', '.join(GROUPS)}")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    path = args.smollm2 or (smollm2_path() if "smollm2" in names or "memory" in names else None)
    if args.json:
        try:
            out = run_groups(args.lib, names, args.quick, path, peer_mode=args.lib != "nnsight_lite",
                             log=lambda *a: print(*a, file=sys.stderr))
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            sys.exit(1)
        print(json.dumps(out))
        return
    print(f"measuring {', '.join(names)} ({'quick' if args.quick else 'full'})", file=sys.stderr)
    ours = run_groups("nnsight_lite", names, args.quick, path, peer_mode=False,
                      log=lambda *a: print(*a, file=sys.stderr))
    peer = run_peer(args.peer, names, args.quick, path) if args.peer else None
    import transformers

    header = (f"{time.strftime('%Y-%m-%d')}, {machine()}, Python {platform.python_version()}, "
              f"torch {torch.__version__}, transformers {transformers.__version__}, 1 thread; "
              f"nnsight_lite {ours['version']}"
              + (f", nnsight {peer['version']}" if peer else "")
              + ("; --quick (few reps: not for quoting)" if args.quick else ""))
    print(render(header, ours, peer))


if __name__ == "__main__":
    main()
