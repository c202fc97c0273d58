"""The printed table (markdown, so it can go into the README as it is) and the targets.

    ROWS                  (row, group, case label, hooks key, library key, base key)
    render(header, ours, peer)   the whole report
"""

from __future__ import annotations

from _timing import over as _over
from cases import GPT_LAYERS, INVOKES, N_LAYERS

#: (issue row, group, label, hooks case, library case, base case). The "over" columns subtract
#: the base case (the plain forward unless named), measured in the same process.
ROWS = [
    ("1", "linear", "24 x Linear(64): trace, save the output", "hooks.empty", "lib.empty", "plain"),
    ("1", "linear", "save the last layer's output", "hooks.save_last", "lib.save_last", "plain"),
    ("1", "linear", "save all 24 outputs", "hooks.save_all", "lib.save_all", "plain"),
    ("1", "linear", "edit all 24 in place", "hooks.edit_all", "lib.edit_all", "plain"),
    ("1", "linear", "replace all 24", "hooks.replace_all", "lib.replace_all", "plain"),
    ("2", "gpt2", "tiny GPT-2 (12 x 64, 10 tokens): save one block", "hooks.save_one",
     "lib.save_one", "plain"),
    ("2", "gpt2", "save all 12 blocks", "hooks.save_all", "lib.save_all", "plain"),
    ("2", "gpt2", "zero all 12 MLP outputs", "hooks.zero_mlps", "lib.zero_mlps", "plain"),
    ("2", "gpt2", "cache every module's output (tracer.cache())",
     "hooks.cache_all", "lib.cache_all", "plain"),
] + [
    ("2", "gpt2", f"{n} invoke(s), each saving the last block (base: {n} batched)",
     f"hooks.invokes_{n}", f"lib.invokes_{n}", f"hooks.invokes_{n}") for n in INVOKES
] + [
    ("2", "gpt2", f"the same, {n} invoke(s), plain NNsight wrapper (no tokenizer, no mask)",
     f"hooks.invokes_{n}", f"lib.nn_invokes_{n}", f"hooks.invokes_{n}") for n in INVOKES
] + [
    ("3", "grads", "forward + backward reading 1 block grad (retain_grad)", "hooks.grad_1",
     "lib.grad_1", "plain"),
    ("3", "grads", "forward + backward reading 12 block grads", "hooks.grad_12", "lib.grad_12",
     "plain"),
    ("3", "grads", "plain loss.backward(): without / with nnsight_lite's patch",
     "hooks.backward", "lib.backward", "hooks.backward"),
    ("4", "generate", "generate 50 tokens, save the last block each step", "hooks.generate",
     "lib.generate", "plain"),
    ("5", "smollm2", "SmolLM2-135M: tokenizer alone (not in plain)", "hooks.tokenize",
     "lib.tokenize", None),
    ("5", "smollm2", "trace given token ids, save nothing", "hooks.empty", "lib.empty", "plain"),
    ("5", "smollm2", "token ids: save 30 layers + logits", "hooks.save_all", "lib.save_all",
     "plain"),
    ("5", "smollm2", "prompt (tokenized in the trace): save 30 + logits",
     "hooks.save_all_prompt", "lib.save_all_prompt", "plain"),
    ("5", "smollm2", "nnsight_lite's wrappers on and off alone", "hooks.install", "lib.install",
     None),
    ("7", "cold", "first trace at a new call site (base: later ones)", None, "lib.cold",
     "lib.warm"),
]


def _get(res, group, key):
    if res is None or key is None:
        return None
    return res["groups"].get(group, {}).get(key)


def _fmt(s, spread=True) -> str:
    if s is None:
        return "-"
    m = s["median"]
    digits = 0 if m >= 1000 else 1
    if not spread:
        return f"{m:.{digits}f}"
    return f"{m:.{digits}f} ({s['min']:.{digits}f}-{s['max']:.{digits}f})"


def _ratio(a, b) -> str:
    if a is None or b is None or b <= 0 or a < 0:
        return "-"
    return f"{a / b:.2f}x"


def _o(x) -> str:
    return "-" if x is None else (f"{x:+.0f}" if abs(x) >= 1000 else f"{x:+.1f}")


def table(ours, peer) -> list[str]:
    lines = [
        "| row | case | base µs | bare hooks µs | nnsight_lite µs | nnsight µs | over base: "
        "hooks / lite / nnsight µs | lite ÷ hooks (over) | nnsight ÷ lite (over) | lite ÷ base |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row, group, label, hk, lk, bk in ROWS:
        lite = _get(ours, group, lk)
        if lite is None:
            continue
        hooks = _get(ours, group, hk)
        base = _get(ours, group, bk)
        nns = _get(peer, group, lk)
        nns_base = _get(peer, group, bk)
        if bk is not None and bk.startswith("hooks.") and peer is not None:
            nns_base = None  # the peer does not time bare hooks: no base for it
        if bk is None:  # rows without a base: their own times are the cost
            o_h, o_l, o_n = (s["median"] if s else None for s in (hooks, lite, nns))
        else:
            o_h, o_l, o_n = _over(hooks, base), _over(lite, base), _over(nns, nns_base)
        whole = _ratio(lite["median"], base["median"]) if base else "-"
        lines.append(
            f"| {row} | {label} | {_fmt(base, False)} | {_fmt(hooks)} | {_fmt(lite)} | "
            f"{_fmt(nns)} | {_o(o_h)} / {_o(o_l)} / {_o(o_n)} | {_ratio(o_l, o_h)} | "
            f"{_ratio(o_n, o_l)} | {whole} |")
    return lines


def _fit(ns, ys):
    """Least squares y = a + b n: (a, b)."""
    k = len(ns)
    mn, my = sum(ns) / k, sum(ys) / k
    b = sum((n - mn) * (y - my) for n, y in zip(ns, ys)) / sum((n - mn) ** 2 for n in ns)
    return my - b * mn, b


def targets(ours, peer) -> list[str]:
    """The issue's targets, each with its measured value and MET / MISSED."""
    g = ours["groups"]
    out = []

    def line(what, value, goal, ok):
        out.append(f"- {what}: {value} (target {goal}) **{'MET' if ok else 'MISSED'}**")

    def m(group, key):
        s = g.get(group, {}).get(key)
        return None if s is None else s["median"]

    def over(group, key, base):  # key over base, round by round (see _timing.over)
        return _over(g.get(group, {}).get(key), g.get(group, {}).get(base))

    if "linear" in g:
        fixed = over("linear", "lib.save_last", "plain")
        fixed_h = over("linear", "hooks.save_last", "plain")
        line("fixed cost of a trace (row 1, save the last output, over plain)",
             f"{fixed:.1f} µs = {fixed / fixed_h:.1f}x the bare hook's {fixed_h:.1f} µs",
             "<= 3x the hook's and < 15 µs", fixed <= 3 * fixed_h and fixed < 15)
        for what, key in (("read", "save_all"), ("edited in place", "edit_all"),
                          ("replaced", "replace_all")):
            lite = over("linear", f"lib.{key}", "lib.save_last") / (N_LAYERS - 1)
            hook = over("linear", f"hooks.{key}", "hooks.save_last") / (N_LAYERS - 1)
            line(f"each module {what}, row 1", f"{lite:.2f} µs vs the hook's {hook:.2f} µs = "
                 f"{lite / hook:.2f}x", "<= 1.1x", lite <= 1.1 * hook)
    if "gpt2" in g:
        lite = over("gpt2", "lib.save_all", "lib.save_one") / (GPT_LAYERS - 1)
        hook = over("gpt2", "hooks.save_all", "hooks.save_one") / (GPT_LAYERS - 1)
        line("each block read, row 2", f"{lite:.2f} µs vs the hook's {hook:.2f} µs = "
             f"{lite / hook:.2f}x", "<= 1.1x", lite <= 1.1 * hook)

        def slope(key):  # both against the same base: the N prompts batched, one hook
            diffs = [over("gpt2", f"lib.{key}_{n}", f"hooks.invokes_{n}") for n in INVOKES]
            return None if None in diffs else _fit(INVOKES, diffs)

        a, b = slope("invokes")
        bare = slope("nn_invokes")
        extra = "" if bare is None else f"; plain NNsight wrapper {bare[1]:.2f} µs"
        line("one more invoke (row 2, slope over 1..64 invokes)", f"{b:.2f} µs (intercept "
             f"{a:.1f} µs{extra})", "< 6 µs", b < 6)
    if "generate" in g:
        r = m("generate", "lib.generate") / m("generate", "hooks.generate")
        line("generate 50 tokens against plain generate with hooks (row 4)", f"{r:.3f}x",
             "<= 1.02x", r <= 1.02)
    if "smollm2" in g:
        plain = m("smollm2", "plain")
        for key, what in (("lib.save_all", "token ids"), ("lib.save_all_prompt", "prompt")):
            r = m("smollm2", key) / plain
            extra = ""
            if peer and peer["groups"].get("smollm2", {}).get(key):
                pr = peer["groups"]["smollm2"][key]["median"] / peer["groups"]["smollm2"][
                    "plain"]["median"]
                extra = f"; nnsight {pr:.3f}x"
            if key.endswith("prompt"):
                tok = m("smollm2", "lib.tokenize")
                extra += f"; the tokenizer alone is {tok:.0f} µs = {tok / plain:.3f}x"
            line(f"SmolLM2, 30 layers + logits saved, {what} (row 5)", f"{r:.3f}x plain{extra}",
                 "<= 1.01x, ahead of nnsight", r <= 1.01)
        inst = m("smollm2", "lib.install")
        if inst is not None:
            line("wrappers on and off on SmolLM2 (per trace)", f"{inst:.1f} µs", "< 30 µs",
                 inst < 30)
    if "memory" in g:
        mem = g["memory"]["memory"]
        line("retained after 1,000 traces saving one activation (row 6)",
             f"{mem['retained_tensors']} tensors, {mem['retained_heap_kb']:.0f} kB Python heap, "
             f"{mem['retained_rss_kb']} kB resident", "no growth",
             mem["retained_tensors"] <= 0 and mem["retained_heap_kb"] < 64)
        if "peak_plain_kb" in mem:
            d = mem["peak_trace_kb"] - mem["peak_plain_kb"]
            line("peak resident memory of a forward, trace saving nothing vs plain (row 6)",
                 f"{mem['peak_trace_kb'] / 1024:.1f} vs {mem['peak_plain_kb'] / 1024:.1f} MB "
                 f"({d:+.0f} kB)", "no more than plain", d <= 256)
    if "cold" in g:
        cold = over("cold", "lib.cold", "lib.warm")
        line("first trace at a new call site, over a later one (row 7)", f"{cold / 1000:.2f} ms",
             "< 2 ms", cold < 2000)
    return out


def render(header: str, ours, peer) -> str:
    lines = [f"Measured {header}.", "", *table(ours, peer), ""]
    lines.append("Cells: median (min-max) µs. 'over base' subtracts the base case measured in "
                 "the same process (nnsight's in its own), round by round: the median over rounds "
                 "of the difference of the two cases' medians in that round. Ratios compare "
                 "those overheads.")
    if peer and peer.get("failed"):
        lines.append("")
        lines.append("nnsight cases that could not run or did not match: " + "; ".join(
            f"{k}: {v}" for k, v in peer["failed"].items()))
    if peer and "memory" in peer["groups"]:
        mem = peer["groups"]["memory"]["memory"]
        lines.append("")
        lines.append(f"nnsight, row 6: {mem['retained_tensors']} tensors, "
                     f"{mem['retained_heap_kb']:.0f} kB heap retained after 1,000 traces"
                     + (f"; peak {mem['peak_trace_kb'] / 1024:.1f} vs plain "
                        f"{mem['peak_plain_kb'] / 1024:.1f} MB" if "peak_plain_kb" in mem else ""))
    lines += ["", "Targets:", *targets(ours, peer)]
    return "\n".join(lines)
