"""Step loops and caches (properties 8 and 9): ``tracer.iter`` and ``tracer.cache()`` against
plain forward hooks on random models.

    test_iter_loops_equal_hooks              trees with modules called several times (a module
                                             calling its child twice, one module at two
                                             paths): a ``for step in tracer.iter[...]`` loop
                                             (bounded, stepped, open or a list of steps) that
                                             reads and edits modules at every step equals hooks
                                             counting calls; a loop whose reads go back raises
                                             OutOfOrderError, one that outruns the calls ends
                                             with the forward (a read after it says so)
    test_cache_equals_hooks                  every module's (or a random subset's) cached
                                             outputs and inputs, after the body's edits, equal
                                             live hook values; keys in the order reached
    test_invoke_caches_equal_separate_traces one cache per invoke equals that invoke's own
                                             trace's cache; an empty invoke's is the batch's

Run: ``CI=true pytest tests/property`` (deterministic); ``HYPOTHESIS_PROFILE=thorough`` for more.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from nnsight_lite import MissedModuleError, NNsight, OutOfOrderError
from tests.strategies import (
    Op,
    assert_same,
    batch_sizes,
    build,
    envoys_of,
    forward_events,
    inplace_edit,
    inputs,
    leftovers,
    model_specs,
    programs,
    reference,
    replaced,
    run_op,
    run_program,
    seeds,
    snapshot,
)

pytestmark = pytest.mark.timeout(60)
envoys: dict = {}  # set per example; bodies read it as a global

# --------------------------------------------------------------------------- step loops


class Twice(torch.nn.Module):
    """An inner Linear called twice (a shared module below the root)."""

    def __init__(self, d):
        super().__init__()
        self.inner = torch.nn.Linear(d, d)

    def forward(self, x):
        return self.inner(torch.nn.functional.gelu(self.inner(x)))


class Alias(torch.nn.Module):
    """Holds an earlier pool module: one module at two paths."""

    def __init__(self, other):
        super().__init__()
        self.other = other

    def forward(self, x):
        return self.other(x) * 0.5


class Pool(torch.nn.Module):
    """The root: calls its pool modules in ``plan`` order (indices repeat: shared modules)."""

    def __init__(self, kinds, plan, d, seed):
        super().__init__()
        torch.manual_seed(seed)
        mods = []
        for k in kinds:
            if k == "linear" or (k == "alias" and not mods):
                mods.append(torch.nn.Linear(d, d))
            elif k == "twice":
                mods.append(Twice(d))
            else:
                mods.append(Alias(mods[0]))
        self.mods = torch.nn.ModuleList(mods)
        self.plan = plan

    def forward(self, x):
        for i in self.plan:
            x = self.mods[i](x)
        return x


@st.composite
def pools(draw):
    kinds = draw(st.lists(st.sampled_from(["linear", "twice", "alias"]), min_size=1, max_size=3))
    plan = draw(st.lists(st.integers(0, len(kinds) - 1), min_size=1, max_size=6))
    return Pool(kinds, plan, draw(st.integers(1, 3)), draw(st.integers(0, 999)))


@dataclasses.dataclass(frozen=True)
class R:
    """One read or edit a loop makes at every step (the step is the call it addresses)."""

    path: str
    kind: str
    action: str
    scale: float
    shift: float
    column: int


@st.composite
def loop_programs(draw, paths):
    reads = draw(st.lists(st.builds(
        R, st.sampled_from(paths), st.sampled_from(["output", "input"]),
        st.sampled_from(["read", "read", "replace", "inplace"]),
        st.sampled_from([0.0, -1.0, 2.0]), st.sampled_from([0.0, 1.0]), st.integers(0, 3)),
        min_size=1, max_size=3))
    reads = [dataclasses.replace(r, action="replace") if r.kind == "input" and r.action == "inplace"
             else r for r in reads]
    form = draw(st.sampled_from(["slice", "slice", "open", "list"]))
    start = draw(st.integers(0, 2))
    if form == "slice":
        sl = slice(start, start + draw(st.integers(1, 4)), draw(st.sampled_from([None, 1, 2])))
    elif form == "open":
        sl = slice(start, None)
    else:
        sl = sorted(set(draw(st.lists(st.integers(0, 4), min_size=1, max_size=3))))
    return reads, sl, form


def as_op(r, call, events):
    idx = next((e.index for e in events if (e.path, e.kind, e.call) == (r.path, r.kind, call)),
               None)
    return Op(r.action, r.path, r.kind, call, idx, r.scale, r.shift, r.column, 0)


def expected(reads, sl, form, events):
    """(the ops that run, outcome): outcome None, "ends" (a step asks for a call the module
    never makes: the loop ends with the forward), OutOfOrderError or MissedModuleError."""
    calls = {}
    for e in events:
        calls[e.path] = max(calls.get(e.path, 0), e.call + 1)
    steps = range(sl.start or 0, sl.stop if sl.stop is not None else 10**6, sl.step or 1) \
        if isinstance(sl, slice) else sl
    done, last = [], -1
    for i in steps:
        for r in reads:
            op = as_op(r, i, events)
            if op.event is None:
                if i > 0 and calls.get(r.path, 0) > 0:
                    return done, "ends"
                return done, MissedModuleError
            if op.event < last:
                return done, OutOfOrderError
            last = op.event
            done.append(op)
    return done, None


def body_op(env, r, results):
    """What the loop body does for ``r`` at the current step."""
    if r.action == "read":
        results.append(snapshot(env.output if r.kind == "output" else env.input))
    elif r.action == "inplace":
        inplace_edit(Op("inplace", shift=r.shift, column=r.column), env.output)
    elif r.kind == "output":
        env.output = replaced(Op("replace", scale=r.scale, shift=r.shift), env.output)
    else:
        env.input = replaced(Op("replace", scale=r.scale, shift=r.shift), env.input)


@given(module=pools(), n=batch_sizes, seed=seeds, data=st.data())
def test_iter_loops_equal_hooks(module, n, seed, data):
    first = module.mods[0]
    width = (first if isinstance(first, torch.nn.Linear) else first.inner).in_features
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(seed))
    events = forward_events(module, x)
    paths = sorted({e.path for e in events if e.path})
    reads, sl, form = data.draw(loop_programs(paths))
    done, outcome = expected(reads, sl, form, events)
    event(f"outcome {outcome}")
    want, want_out, _ = reference(module, x, done)
    model = NNsight(module)
    envoys = envoys_of(model)
    results = []
    got_out = []
    try:
        with model.trace(x) as tracer:
            for step in tracer.iter[sl]:
                for r in reads:
                    body_op(envoys[r.path], r, results)
            got_out.append(model.output.clone())
    except (OutOfOrderError, MissedModuleError) as exc:
        if outcome == "ends":
            assert isinstance(exc, MissedModuleError), exc
            assert "step loop" in str(exc), exc
            assert ("open step loop" in str(exc)) == (form == "open"), exc
        else:
            assert outcome is type(exc), (outcome, exc)
    else:
        assert outcome is None, outcome
        assert_same(got_out[0], want_out.detach(), exact=False)
    assert len(results) == sum(op.action == "read" for op in done)
    for g, w in zip(results, want):
        assert_same(g, w, exact=False)
    assert not leftovers(module)


# --------------------------------------------------------------------------- caches


def hook_cache(module, x, ops, paths=None):
    """{path: ([outputs], [inputs])} after ops, live values (in-place edits later show)."""
    at = defaultdict(list)
    for op in ops:
        at[(op.path, "input" if op.kind in ("input", "inputs") else "output", op.call)].append(op)
    rec = {}
    counts = defaultdict(int)
    handles = []

    def pre(name):
        def hook(mod, args, kwargs):
            for op in at.get((name, "input", counts[name]), ()):
                if op.action == "replace":
                    args = (replaced(op, args[0]),) + tuple(args[1:])
            if paths is None or name in paths:
                rec.setdefault(name, ([], []))[1].append(args[0])
            return args, kwargs
        return hook

    def post(name):
        def hook(mod, args, kwargs, out):
            call = counts[name]
            counts[name] += 1
            for op in at.get((name, "output", call), ()):
                if op.action == "inplace":
                    inplace_edit(op, out)
                elif op.action == "replace":
                    out = replaced(op, out)
            if paths is None or name in paths:
                rec[name][0].append(out)
            return out
        return hook

    try:
        for name, m in module.named_modules():
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post(name), with_kwargs=True))
        with torch.no_grad():
            module(x)
    finally:
        for h in handles:
            h.remove()
    return rec


def key(path):
    return "model" + ("." + path if path else "")


def check(cache, rec, order):
    assert list(cache.keys()) == [key(p) for p in order], (list(cache.keys()), order)
    for p, (outs, ins) in rec.items():
        e = cache[key(p)]
        got = e.output
        want = outs[0] if len(outs) == 1 else outs
        assert_same(got, want, exact=False)
        gin = e.input
        win = ins[0] if len(ins) == 1 else ins
        assert_same(gin, win, exact=False)


def called(module, paths):
    """The modules a cache of ``paths`` records: a container that is never called itself (a
    ModuleList) stands for the modules it holds."""
    named = dict(module.named_modules())
    names = {id(m): n for n, m in named.items()}
    out = []

    def add(m):
        if type(m).forward is torch.nn.Module.forward:
            for child in m.children():
                add(child)
        elif names[id(m)] not in out:
            out.append(names[id(m)])

    for p in paths:
        add(named[p])
    return out


def reached(events, paths=None):
    out = []
    for e in events:
        if e.kind == "input" and e.path not in out and (paths is None or e.path in paths):
            out.append(e.path)
    return out


@given(spec=model_specs(), seed=seeds, n=batch_sizes, some=st.booleans(), data=st.data())
def test_cache_equals_hooks(spec, seed, n, some, data):
    module = build(spec)
    (x,) = inputs(spec, [n], seed)
    events = forward_events(module, x)
    model = NNsight(module)
    envoys.clear()
    envoys.update(envoys_of(model))
    program = data.draw(programs(events, edits=True, max_size=6))
    paths = None
    if some:
        all_paths = [p for p, _ in module.named_modules()]
        paths = data.draw(st.lists(st.sampled_from(all_paths), min_size=1, unique=True))
    mods = None if paths is None else [key(p) for p in paths]
    if paths is not None:
        paths = called(module, paths)
    rec = hook_cache(module, x, program, paths)
    order = reached(events, paths)
    results = []
    with model.trace(x) as tracer:
        cache = tracer.cache(modules=mods, include_inputs=True)
        offsets = {}
        for op in program:
            run_op(op, envoys, offsets, results)
    check(cache, rec, order)
    assert not leftovers(module)


@given(spec=model_specs(), seed=seeds, sizes=st.lists(batch_sizes, min_size=1, max_size=3),
       data=st.data())
def test_invoke_caches_equal_separate_traces(spec, seed, sizes, data):
    module = build(spec)
    xs = inputs(spec, sizes, seed)
    events = forward_events(module, xs[0])
    model = NNsight(module)
    envoys.clear()
    envoys.update(envoys_of(model))
    progs = [data.draw(programs(events, edits=True, max_size=4)) for _ in xs]
    # one invoke's replacement gives the others a copy of their rows (Known gaps), so an
    # in-place edit of a value aliasing an earlier one differs: edits of one kind per trace
    kind = data.draw(st.sampled_from(["inplace", "replace"]))
    progs = [[op for op in p if op.action in ("read", kind)] for p in progs]
    whole = data.draw(st.booleans())
    sep = []
    for x, program in zip(xs, progs):
        with model.trace(x) as tracer:
            c = tracer.cache(include_inputs=True)
            run_program(program, envoys, [])
        sep.append(c)
    caches = []
    jobs = iter(progs)
    with model.trace() as tracer:
        for x in xs:
            with tracer.invoke(x):
                caches.append(tracer.cache(include_inputs=True))
                run_program(next(jobs), envoys, [])
        if whole:
            with tracer.invoke():
                caches.append(tracer.cache())
    for got, want in zip(caches, sep):
        assert list(got.keys()) == list(want.keys())
        for k in want.keys():
            assert_same(got[k].output, want[k].output, exact=False)
            assert_same(got[k].inputs, want[k].inputs, exact=False)
    if whole:
        rec = hook_cache(module, torch.cat(xs), [])
        if not any(op.action != "read" for p in progs for op in p):
            for p, (outs, _) in rec.items():
                assert_same(caches[-1][key(p)].output, outs[0] if len(outs) == 1 else outs,
                            exact=False)
    assert not leftovers(module)
