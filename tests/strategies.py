"""Hypothesis strategies and plain-PyTorch references shared by the property tests.

    model_specs()              random small models: depth, widths, branching, tuple outputs,
                               a module reused at two places, optionally a module that never runs
    build(spec)                the ``torch.nn.Module`` a spec describes (seeded, deterministic)
    inputs(spec, sizes, seed)  one input batch per invoke
    forward_events(module, x)  the plain forward's events in execution order, with their values
    programs(events, ...)      lists of Op: reads and edits at events, in or out of order
    edit_programs(events)      in-order lists of edits only (persistent ``model.edit()`` bodies)
    reference(module, x, ops)  what plain forward hooks see and do for the same ops (optionally
                               with outputs patched to values carried over from another run)
    run_op(op, envoys, ...)    what a trace body does for one Op (called from literal bodies)
    rewind(env, offsets)       back to call 0 after a program's .next() moves
    leftovers(module)          hooks, traced forwards, suspended body greenlets left behind
    torch_modes()              grad / inference / autocast state, to compare before and after

An *event* is one moment of the forward where a body can ask for a value:
``(path, "input", call)`` when the module at ``path`` is entered for its ``call``-th time and
``(path, "output", call)`` when that call returns. A body that asks for events in increasing
event order must succeed; asking for an earlier event than the last one asked for must raise
``OutOfOrderError``. Bodies are ordinary Python, so the tests write the ``with`` blocks
literally and loop over the generated ops inside them, calling :func:`run_op` for each.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
from hypothesis import strategies as st

from tests.helpers import suspended_bodies

# --------------------------------------------------------------------------- models


class Tupled(torch.nn.Module):
    """Returns ``(h, h.sum(-1))`` like older Hugging Face blocks."""

    def __init__(self, d_in, d_out):
        super().__init__()
        self.lin = torch.nn.Linear(d_in, d_out)

    def forward(self, x):
        h = self.lin(x)
        return h, h.sum(-1)


class Branch(torch.nn.Module):
    """Two children on the same input; their sum, or both as a tuple."""

    def __init__(self, d_in, d_out, tuple_out):
        super().__init__()
        self.tuple_out = tuple_out
        self.a = torch.nn.Linear(d_in, d_out)
        self.b = torch.nn.Sequential(torch.nn.Linear(d_in, d_out), torch.nn.GELU())

    def forward(self, x):
        a = self.a(x)
        b = self.b(x)
        return (a, b) if self.tuple_out else a + b


def combine(out):
    """A stage's output as the next stage's input (tuples are folded into one tensor)."""
    if isinstance(out, tuple):
        h = out[0]
        for e in out[1:]:
            h = h + (e.unsqueeze(-1) if e.dim() == 1 else e)
        return h
    return out


class Chain(torch.nn.Module):
    """A nested block: its stages in order."""

    def __init__(self, stages):
        super().__init__()
        self.layers = torch.nn.ModuleList(stages)

    def forward(self, x):
        h = x
        for layer in self.layers:
            h = combine(layer(h))
        return h


class RandNet(torch.nn.Module):
    """The root of a generated model: ``layers`` interleaved with calls of ``shared``."""

    def __init__(self, stages, plan, shared_width, unused):
        super().__init__()
        self.layers = torch.nn.ModuleList(stages)
        self.shared = torch.nn.Linear(shared_width, shared_width) if "shared" in plan else None
        self.unused = torch.nn.Linear(2, 2) if unused else None
        self.plan = plan
        self.bomb = None  # (plan position, exception): raise there (fault injection)

    def forward(self, x):
        h = x
        for pos, step in enumerate(self.plan):
            if self.bomb is not None and self.bomb[0] == pos:
                raise self.bomb[1]
            layer = self.shared if step == "shared" else self.layers[step]
            h = combine(layer(h))
        return h


@dataclasses.dataclass(frozen=True)
class Spec:
    """A model description hypothesis can shrink. ``stages`` holds nested stage tuples:
    ("linear", out) | ("act",) | ("tuple", out) | ("branch", out, tuple_out) | ("block", stages)
    at the root also ("shared",), a call of the root's one shared Linear."""

    in_width: int
    shared_width: int
    stages: tuple
    unused: bool
    seed: int


_widths = st.integers(1, 5)


def _stage(depth):
    leaf = st.one_of(
        st.tuples(st.just("linear"), _widths),
        st.tuples(st.just("act")),
        st.tuples(st.just("tuple"), _widths),
        st.tuples(st.just("branch"), _widths, st.booleans()),
    )
    if depth == 0:
        return leaf
    return st.one_of(
        leaf,
        st.tuples(st.just("block"), st.lists(_stage(depth - 1), min_size=1, max_size=3).map(tuple)),
    )


@st.composite
def model_specs(draw, max_stages=5):
    """Random small models; "shared" appears 0, 1 or 2 times at the root (2: a reused module)."""
    stages = draw(st.lists(_stage(2), min_size=1, max_size=max_stages))
    n_shared = draw(st.sampled_from([2, 2, 1, 0]))
    for _ in range(n_shared):
        stages.insert(draw(st.integers(0, len(stages))), ("shared",))
    return Spec(
        in_width=draw(_widths),
        shared_width=draw(_widths),
        stages=tuple(stages),
        unused=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _build_stage(stage, d):
    kind = stage[0]
    if kind == "linear":
        return torch.nn.Linear(d, stage[1]), stage[1]
    if kind == "act":
        return torch.nn.GELU(), d
    if kind == "tuple":
        return Tupled(d, stage[1]), stage[1]
    if kind == "branch":
        return Branch(d, stage[1], stage[2]), stage[1]
    if kind == "block":
        subs = []
        for s in stage[1]:
            m, d = _build_stage(s, d)
            subs.append(m)
        return Chain(subs), d
    raise ValueError(stage)


def build(spec: Spec) -> RandNet:
    """The model ``spec`` describes, with weights from ``spec.seed``."""
    torch.manual_seed(spec.seed)
    d = spec.in_width
    stages, plan = [], []
    for stage in spec.stages:
        if stage[0] == "shared":
            if d != spec.shared_width:  # adapt the width so the shared Linear fits
                stages.append(torch.nn.Linear(d, spec.shared_width))
                plan.append(len(stages) - 1)
                d = spec.shared_width
            plan.append("shared")
            continue
        m, d = _build_stage(stage, d)
        stages.append(m)
        plan.append(len(stages) - 1)
    return RandNet(stages, plan, spec.shared_width, spec.unused)


def inputs(spec: Spec, sizes, seed: int):
    """One ``(size, in_width)`` input per invoke."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, spec.in_width, generator=g) for n in sizes]


batch_sizes = st.integers(1, 3)
seeds = st.integers(0, 2**16)

# --------------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True)
class Event:
    index: int  # position in execution order
    path: str  # named_modules() path ("" for the root)
    kind: str  # "input" | "output"
    call: int
    tensor_elems: int  # output: how many tensors it holds (1, or the tuple's length)
    origin: tuple  # output: for each tensor element, the first event (index, elem) that held it


def forward_events(module: torch.nn.Module, *args) -> list[Event]:
    """The events of a plain forward of ``module(*args)``, in execution order."""
    events, handles, counts = [], [], defaultdict(int)
    first_seen: dict = {}
    keep = []  # keep tensors alive so ids stay unique

    def pre(name):
        def hook(mod, a, k):
            events.append(Event(len(events), name, "input", counts[name], 0, ()))
        return hook

    def post(name):
        def hook(mod, a, k, out):
            elems = list(out) if isinstance(out, tuple) else [out]
            origin = []
            for j, t in enumerate(elems):
                keep.append(t)
                origin.append(first_seen.setdefault(id(t), (len(events), j)))
            events.append(Event(len(events), name, "output", counts[name], len(elems), tuple(origin)))
            counts[name] += 1
        return hook

    try:
        for name, m in module.named_modules():
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post(name), with_kwargs=True))
        with torch.no_grad():
            module(*args)
    finally:
        for h in handles:
            h.remove()
    return events


def never_events(module: RandNet, events: list[Event]) -> list[tuple]:
    """(path, kind, call) requests that never happen: a module that is not called, and one
    call past the last call of a module that is."""
    out = []
    if module.unused is not None:
        out.append(("unused", "output", 0))
    calls = defaultdict(int)
    for e in events:
        if e.kind == "output":
            calls[e.path] = max(calls[e.path], e.call + 1)
    for path, n in sorted(calls.items()):
        out.append((path, "output", n))
    return out


# --------------------------------------------------------------------------- programs


@dataclasses.dataclass(frozen=True)
class Op:
    """One step of a body's program.

    action: "read" | "inplace" | "replace" | "raise" | "stop" | "read_no_grad" |
            "read_autocast" | "read_inference" | "grad_off"
    kind:   "output" | "input" | "inputs" (for reads; edits use "output" or "input")
    event:  index into the events, or None for a request that never happens
    """

    action: str
    path: str = ""
    kind: str = "output"
    call: int = 0
    event: int | None = None
    scale: float = 1.0
    shift: float = 0.0
    column: int = 0
    elem: int = 0
    exc: str = ""


EXCEPTIONS = {
    "ValueError": lambda: ValueError("injected"),
    "KeyboardInterrupt": lambda: KeyboardInterrupt("injected"),
    "SystemExit": lambda: SystemExit("injected"),
}

_scales = st.sampled_from([0.0, -1.0, 0.5, 2.0])
_shifts = st.sampled_from([0.0, 1.0, -0.25])


@st.composite
def op_at(draw, event: Event, *, edits: bool = True, modes: bool = False):
    """A read or edit of ``event``."""
    actions = ["read"]
    if edits:
        actions += ["replace"] + (["inplace"] if event.kind == "output" else [])
    if modes:
        actions += ["read_no_grad", "read_autocast", "read_inference"]
    action = draw(st.sampled_from(actions))
    kind = event.kind
    if action == "read" and kind == "input":
        kind = draw(st.sampled_from(["input", "inputs"]))
    return Op(
        action=action, path=event.path, kind=kind, call=event.call, event=event.index,
        scale=draw(_scales), shift=draw(_shifts), column=draw(st.integers(0, 7)),
        elem=draw(st.integers(0, 1)),
    )


@st.composite
def programs(draw, events, *, edits=True, in_order=True, modes=False, max_size=8):
    """A list of Ops at random events. ``in_order``: event indices never decrease."""
    idx = draw(st.lists(st.integers(0, len(events) - 1), min_size=1, max_size=max_size))
    if in_order:
        idx.sort()
    return [draw(op_at(events[i], edits=edits, modes=modes)) for i in idx]


def as_edit(op: Op) -> Op:
    """``op`` as an edit: a read becomes a replacement of the same value."""
    if op.action != "read":
        return op
    return dataclasses.replace(op, action="replace", kind="input" if op.kind == "inputs" else op.kind)


def edit_programs(events, max_size=3):
    """In-order programs of edits only (what a persistent ``model.edit()`` body does)."""
    return programs(events, edits=True, max_size=max_size).map(lambda p: [as_edit(op) for op in p])


def first_disorder(ops) -> int | None:
    """Index of the first op whose event comes before an earlier op's event, or None."""
    last = -1
    for j, op in enumerate(ops):
        if op.event is None:
            continue
        if op.event < last:
            return j
        last = op.event
    return None


# --------------------------------------------------------------------------- doing an op


def snapshot(value):
    """A detached copy of ``value`` (tensors inside tuples, lists and dicts)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


def assert_same(got, want, exact=True):
    """Structural equality; tensors bitwise (``exact``) or with default float tolerance."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), type(got)
        if exact:
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        else:
            torch.testing.assert_close(got, want)
    elif isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), (got, want)
        for g, w in zip(got, want):
            assert_same(g, w, exact)
    elif isinstance(want, dict):
        assert set(got) == set(want)
        for k in want:
            assert_same(got[k], want[k], exact)
    else:
        assert got == want, (got, want)


def inplace_edit(op: Op, value) -> None:
    """Edit a module output in place: one column of a 2-d tensor, or scale a 1-d one."""
    elems = list(value) if isinstance(value, tuple) else [value]
    t = elems[op.elem % len(elems)]
    if t.dim() >= 2:
        t[:, op.column % t.shape[-1]] = op.shift
    else:
        t.mul_(op.scale)


def replaced(op: Op, value):
    """A new value: every tensor scaled and shifted (tuples keep their shape)."""
    if isinstance(value, tuple):
        return tuple(replaced(op, v) for v in value)
    return value * op.scale + op.shift


def address(env, op: Op, offsets: dict):
    """Point ``env`` at call ``op.call`` of its module. ``.next()`` moves the call index of
    every later read in the body (``offsets[None]`` keeps it); a negative step moves it back,
    which out-of-order programs need."""
    cur = offsets.get(None, 0)
    if op.call != cur:
        env.next(op.call - cur)
        offsets[None] = op.call
    return env


def rewind(env, offsets: dict):
    """``env``, with the body's call index moved back to call 0 for the reads that follow."""
    if offsets.get(None):
        env.next(-offsets.pop(None))
    return env


def run_op(op: Op, envoys: dict, offsets: dict, results: list, tracer=None) -> None:
    """Do ``op`` from inside a trace body; reads append ``(op position tag, snapshot)``."""
    a = op.action
    if a == "raise":
        if op.kind == "in_mode":  # raise while inside torch modes the body entered
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                raise EXCEPTIONS[op.exc]()
        raise EXCEPTIONS[op.exc]()
    if a == "stop":
        tracer.stop()
    if a == "grad_off":
        torch.set_grad_enabled(False)
        return
    env = address(envoys[op.path], op, offsets)
    if a == "read":
        v = env.output if op.kind == "output" else (env.input if op.kind == "input" else env.inputs)
        results.append(snapshot(v))
    elif a == "inplace":
        inplace_edit(op, env.output)
    elif a == "replace":
        if op.kind == "output":
            env.output = replaced(op, env.output)
        else:
            env.input = replaced(op, env.input)
    elif a == "read_no_grad":
        with torch.no_grad():
            results.append(snapshot(env.output if op.kind == "output" else env.input))
    elif a == "read_autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(snapshot(env.output if op.kind == "output" else env.input))
    elif a == "read_inference":
        with torch.inference_mode():
            results.append(snapshot(env.output if op.kind == "output" else env.input))
    else:
        raise ValueError(a)


def run_program(program, envoys, results, tracer=None) -> None:
    """Run a whole program with its own call offsets (one call per invoke body: invoke bodies
    share one namespace, so per-invoke state must live in a function's frame)."""
    offsets: dict = {}
    for op in program:
        run_op(op, envoys, offsets, results, tracer)


def envoys_of(model) -> dict:
    """``{named_modules() path: Envoy}`` for an NNsight-wrapped model."""
    out = {}
    for name, _ in model._module.named_modules():
        env = model
        for part in name.split(".") if name else []:
            env = env[int(part)] if part.isdigit() else getattr(env, part)
        out[name] = env
    return out


# --------------------------------------------------------------------------- plain references


def reference(module: torch.nn.Module, x, ops, retain=False, patch=None):
    """Plain forward hooks doing ``ops`` (reads and edits) at their events.

    ``patch``: ``{(path, call): value}``, outputs replaced by ``value`` after that event's ops
    (a value carried over from another trace, as sessions do).

    Returns ``(reads, output, outputs)``: the snapshots reads take, in op order; the final
    output; and (with ``retain``) every output event's value after its ops (tensors as a
    list; ``retain_grad()`` called on those that require grad).
    """
    patch = patch or {}
    at = defaultdict(list)
    for op in ops:
        at[(op.path, "input" if op.kind in ("input", "inputs") else "output", op.call)].append(op)
    reads: list = []
    outs: dict = {}
    counts = defaultdict(int)
    handles = []

    def pre(name):
        def hook(mod, args, kwargs):
            key = (name, "input", counts[name])
            for op in at.get(key, ()):
                if op.action == "read":
                    reads.append(snapshot(args[0] if op.kind == "input" else (args, kwargs)))
                elif op.action == "replace":
                    args = (replaced(op, args[0]),) + tuple(args[1:])
            return args, kwargs
        return hook

    def post(name):
        def hook(mod, args, kwargs, out):
            call = counts[name]
            counts[name] += 1
            for op in at.get((name, "output", call), ()):
                if op.action == "read":
                    reads.append(snapshot(out))
                elif op.action == "inplace":
                    inplace_edit(op, out)
                elif op.action == "replace":
                    out = replaced(op, out)
            if (name, call) in patch:
                out = patch[(name, call)]
            if retain:
                elems = list(out) if isinstance(out, tuple) else [out]
                for t in elems:
                    if t.requires_grad:
                        t.retain_grad()
                outs[(name, call)] = elems
            return out
        return hook

    try:
        for name, m in module.named_modules():
            handles.append(m.register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(m.register_forward_hook(post(name), with_kwargs=True))
        out = module(x)
    finally:
        for h in handles:
            h.remove()
    return reads, out, outs


def param_grads(module):
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


# --------------------------------------------------------------------------- invariants


def torch_modes():
    return (
        torch.is_grad_enabled(),
        torch.is_inference_mode_enabled(),
        torch.is_autocast_enabled("cpu"),
        torch.get_autocast_dtype("cpu"),
    )


def leftovers(module: torch.nn.Module) -> list[str]:
    """What a finished trace must not leave: instance forwards, hooks, live body greenlets."""
    bad = []
    for name, m in module.named_modules():
        d = m.__dict__
        if "forward" in d:
            bad.append(f"instance forward left on {name or 'root'}")
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                     "_backward_pre_hooks"):
            if d.get(attr):
                bad.append(f"{attr} left on {name or 'root'}")
    bad.extend(suspended_bodies())
    return bad
