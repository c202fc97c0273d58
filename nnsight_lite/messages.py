"""The errors a body gets for a value it cannot have: built on the failure path only.

    current_mediator's     no invoke body runs here (outside a trace, in a trace that only sets
                           up invokes, in a backward block): no_body_error, backward_block_error
    Mediator's             a module (or operation) that already ran, never ran, ran fewer times,
                           or an input used after .skip(): late_error, missed_error,
                           after_skip_error (methods of Mediator)
    Interleaver.slot_of's  an Envoy the trace has no slot for: its module was replaced or
                           removed (moved_message), or belongs to another model
                           (other_model_message)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import MissedModuleError, OutOfOrderError, OutsideTraceError
from .workers import _getcurrent, user_location

if TYPE_CHECKING:
    from .interleaver import Interleaver
    from .mediator import Mediator


def skipped_above(slot, skipped):
    """The skipped slot among ``slot``'s ancestors, or None."""
    while skipped and slot is not None:
        slot = slot.parent
        if slot in skipped:
            return slot
    return None


def in_backward_block() -> bool:
    """Whether the code running now is the body of a ``with loss.backward():`` block."""
    return getattr(_getcurrent(), "grads", None) is not None


def backward_block_error(what: str, instead: str | None = None) -> OutsideTraceError:
    """The error for ``what`` (an operation on the model's forward: ``tracer.next()``,
    ``model[0].skip()``) used inside a ``with loss.backward():`` block."""
    instead = instead or (f"use {what} in the trace body, before the `with loss.backward():` "
                          "line")
    return OutsideTraceError(
        f"{what} cannot be used inside a `with loss.backward():` block (at {user_location()}): "
        "the forward is over when backprop runs, and a backward block only reads and sets "
        f"gradients (.grad). Instead, {instead}."
    )


def no_body_error(envoy, what: str, action: str) -> OutsideTraceError:
    """Why ``what`` cannot be used here, where no invoke body is running (the failure path of
    current_mediator)."""
    from .mediator import _collecting

    name = f"{envoy._path}.{what}" if envoy is not None else what
    where = user_location()
    if getattr(_collecting, "depth", 0):
        return OutsideTraceError(
            f"{name} was {action} at {where}, in the body of a trace that was given no inputs. "
            "Such a body only sets up invokes: use module values inside a `with "
            "tracer.invoke(...):` block, or pass the inputs to model.trace(...)."
        )
    if in_backward_block():
        if action == "set":
            return backward_block_error(name, f"set {name} in the trace body, before the "
                                        "`with loss.backward():` line")
        if action != "read":
            return backward_block_error(name)
        return OutsideTraceError(
            f"{name} was read inside a `with loss.backward():` block (at {where}). The forward "
            "is over when backprop runs, so only gradients are readable there: bind "
            f"`h = {name}` before the backward block and read `h.grad` inside it."
        )
    if action == "read":
        return OutsideTraceError(
            f"{name} was read outside a trace body (at {where}). Module values exist only while "
            "the model runs: read them inside `with model.trace(...):` (or a `with "
            "tracer.invoke(...):` block) and call .save() on what you want to keep."
        )
    if action == "set":
        return OutsideTraceError(
            f"{name} was set outside a trace body (at {where}). Module values exist only while "
            "the model runs: set them inside `with model.trace(...):` (or a `with "
            "tracer.invoke(...):` block), or in `with model.edit(...):` for an edit that every "
            "trace applies."
        )
    return OutsideTraceError(
        f"{name} was {action} outside a trace body (at {where}); it acts on the model while it "
        "runs: call it inside `with model.trace(...):` (or a `with tracer.invoke(...):` block)."
    )


def _wrapper_ran_instead(inter, mslot) -> "str | None":
    """Why no operation of ``mslot``'s forward ran where the module did run: its forward is a
    decorator's wrapper (``functools.wraps``) whose code did not call the function ``.source``
    lists (transformers' MoE experts dispatch to ``config._experts_implementation``); else
    None."""
    from .instrument import _function_of, _layers, code_qualname

    hit = inter.sources.installed.get(mslot) if inter.sources is not None else None
    if hit is None or any(op.calls for op in hit[1].values()):
        return None
    func = _function_of(hit[0])[0]
    chain = _layers(func) if func is not None else ()
    if len(chain) < 2:
        return None
    outer = chain[0]
    module = mslot.module
    code = outer.__code__
    name = code_qualname(code, outer.__globals__)  # (the wrapper's own, not wraps')
    why = (f"{type(module).__name__}.forward is wrapped by a decorator ({name}, "
           f"{code.co_filename}:{code.co_firstlineno}) that did not call the function it "
           "wraps in this forward (it ran other code instead), so none of that function's "
           "operations ran")
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl is not None and impl != "eager":
        why += (f". transformers runs MoE experts with config._experts_implementation "
                f"({impl!r}): model.set_experts_implementation(\"eager\") before the trace (or "
                "experts_implementation=\"eager\" when loading) runs the code .source lists")
    return why


def never_ran(path: str, envoy, kind: str, inter=None) -> str:
    """Why ``path`` (a module or an operation) has no call in this forward, and where to look."""
    from .source import OpEnvoy, Source

    if isinstance(envoy, OpEnvoy):
        parent = envoy._parent
        if inter is not None and isinstance(parent, Source):  # its module never ran either?
            owner = parent._envoy
            mslot = inter.slots.get(id(parent._module))
            if owner is not None and (mslot is None or not mslot.calls):
                return never_ran(owner._path, owner, kind)
            wrapper = _wrapper_ran_instead(inter, mslot)
            if wrapper is not None:
                return (f"{path} never ran in this forward: " + wrapper
                        + f" (print({parent._path}) lists the function it wraps)")
        comp = parent._compiled()
        line = comp.spans[comp.index[envoy._name]][0]
        return (
            f"{path} never ran in this forward: the line it is on ({comp.filename}:{line}) "
            "did not run (a branch the forward did not take, or code after a return). "
            f"print({parent._path}) shows each operation beside its line: pick one on a line "
            "that runs"
        )
    module = envoy._module if envoy is not None else None
    script = _scripted_above(envoy)
    if script is not None:
        return (
            f"{path} runs inside {script._path}, a TorchScript module (torch.jit.script or "
            f"torch.jit.trace): its compiled code calls {path} without Python, so {path} has no "
            f".{kind} to read. Read {script._path}.output or .input instead, or keep the "
            f"module you read plain PyTorch (script or trace its submodules only)"
        )
    if module is not None and type(module).forward is torch.nn.Module.forward:
        kids = list(module._modules)
        if not kids and not isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            parent = envoy.__dict__.get("_parent")
            parent = parent() if parent is not None else None
            above = parent._path if parent is not None else "the model"
            return (
                f"{path} is a plain {type(module).__name__} with no forward and no modules of "
                f"its own: it only holds parameters or buffers, which the code of {above} uses "
                "directly (as a torch.export'ed program's module() does), so it is never called "
                f"and has no .{kind}. Read the operation that uses them in {above}.source"
            )
        child = (f"{path}[{kids[0]!r}]" if isinstance(module, torch.nn.ModuleDict) else
                 f"{path}[-1]" if isinstance(module, torch.nn.ModuleList) else
                 f"{path}.{kids[0]}") if kids else None
        return (
            f"{path} is a {type(module).__name__}, a container that is never called itself "
            f"(it has no forward), so it has no .{kind} of its own. Read one of the modules it "
            "holds instead" + (f", e.g. {child}.{kind}" if child else "")
        )
    return (
        f"{path} never ran in this forward: the model's forward does not call it (it may be "
        "defined but unused, or called on another path). Check print(model) for the module "
        "that computes the value you want"
    )


def _scripted_above(envoy):
    """The outermost Envoy above ``envoy`` whose module is a TorchScript module (its children
    run inside its compiled code, never as Python calls), or None."""
    found = None
    ref = envoy.__dict__.get("_parent") if envoy is not None else None
    while ref is not None:
        env = ref()
        if env is None:
            break
        if isinstance(env.__dict__.get("_module"), torch.jit.ScriptModule):
            found = env
        ref = env.__dict__.get("_parent")
    return found


def after_skip_error(self: "Mediator", envoy) -> OutOfOrderError:
    """The error for reading or setting a module's input after ``.skip()`` at that call."""
    path = envoy._path
    call = self.iteration
    return OutOfOrderError(
        f"{self.label()} used {path}.input (or .inputs) at {user_location()}" + (
            f" (call {call})" if call else "") + f" after {path}.skip(...) for the same "
        f"call: a skipped module does not run, so its input is no longer used (and it may "
        f"be the very tensor given to skip). Read or edit {path}.input before calling "
        ".skip()."
    )


def _after_loop_error(self: "Mediator", what, where, slot, call, bounded) -> MissedModuleError:
    """A read after a step loop that waited for a call the forward never made."""
    head = f"{self.label()} asked for {what} at {where}, after the model's forward had finished: "
    if bounded:  # the user's own bound outran the model's calls
        return MissedModuleError(
            head + f"the step loop before it (tracer.iter[...]) asked for call {call} of "
            f"{slot.label()}, which ran only {slot.calls} time(s) in this forward, so the loop "
            "ended there with the forward. Bound the loop to the calls the model makes "
            f"(steps below {slot.calls}), or read {what.split(' ')[0]} inside the loop."
        )
    return MissedModuleError(
        head + f"the open step loop before it (tracer.iter[k:] or tracer.all()) waited for "
        f"one more call of {slot.label()}, and such a loop ends only when the forward does. "
        "Read it inside the loop, at the step it runs in, or give the loop its number of "
        "steps (tracer.iter[k:n])."
    )


def late_error(self: "Mediator", envoy, key):
    slot, kind, call = key
    where = user_location()
    what = f"{envoy._path}.{kind}" + (f" (call {call})" if call else "")
    if self.interleaver.finished:
        if self.loop_ended is not None:
            return _after_loop_error(self, what, where, *self.loop_ended)
        return MissedModuleError(
            f"{self.label()} asked for {what} at {where}, after the model's forward "
            "had already finished. Read module values while the model runs, before the end "
            "of the body's last model access."
        )
    pos = self.interleaver.position
    now = f" (the forward is now at {pos[0].label()}.{pos[1]}" + (
        f", call {pos[2]})" if pos[2] else ")") if pos else ""
    if self.waited is not None:
        name, line = self.waited
        return OutOfOrderError(
            f"{self.label()} asked for {what} at {where}, but {envoy._path} had already "
            f"run that call{now}: before it, the body waited at {line} for `{name}`, "
            "which an earlier invoke bound only after that, so the model ran on while it "
            f"waited. An invoke cannot use at {envoy._path} a value another invoke makes "
            "later in the same forward (as when it reads later modules): compute "
            f"`{name}` in a trace of its own first, then use it in a second trace "
            "(`with model.session():` holds both), or bind it in the earlier invoke "
            f"before {envoy._path} runs."
        )
    if pos and pos[0] is slot and pos[2] > call:  # the same module, at a later call
        return OutOfOrderError(
            f"{self.label()} asked for {envoy._path}.{kind} (call {call}) at {where}, but "
            f"{envoy._path} has already run that call (the forward is now at its call "
            f"{pos[2]}). A body reads a module's calls in the order the model makes them: "
            f"read call {call} before a later one" + (
                " (after a tracer.iter loop, reads are at call 0 again: read it inside the "
                "loop, at its step)" if not call else "") +
            ", or address the call you want with .next() or tracer.iter[k]."
        )
    if not call and not self.iter_depth and self.after_loop:  # the first step, after a loop
        return OutOfOrderError(
            f"{self.label()} asked for {envoy._path}.{kind} (call 0) at {where}, after a step "
            f"loop (tracer.iter[...] / tracer.all()) had run the model past that call{now}: "
            "outside a step loop a read is at call 0, the first step, again. Read it inside "
            "the loop, at the step you want (`if step == k:`), or in an empty `with "
            "tracer.invoke():` block after this invoke (which reads from call 0 on)."
        )
    return OutOfOrderError(
        f"{self.label()} asked for {what} at {where}, but {envoy._path} has already "
        f"run that call{now}. A body must read module values in the order the model "
        "computes them: move this line above the access to the later module, or read it "
        "in a separate trace."
    )

def missed_error(self: "Mediator"):
    from .waits import BarrierWait, NameWait

    if isinstance(self.pending, BarrierWait):
        return self.pending.barrier.short_error(self, self.pending)
    if isinstance(self.pending, NameWait):
        return NameError(f"name {self.pending.name!r} is not defined", name=self.pending.name)
    slot, kind, call = self.pending
    envoy = self.pending_envoy
    path = envoy._path if envoy is not None else slot.label()
    where = "<unknown>"
    if self.greenlet is not None and self.greenlet.gr_frame is not None:
        where = user_location(self.greenlet.gr_frame)
    what = f"{path}.{kind}" + (f" (call {call})" if call else "")
    if self.interleaver.stopped_early:
        reason = (f"tracer.stop() at {self.interleaver.stopped_early} ended the forward "
                  "before it ran. Read it before the stop, or stop after the last read "
                  "of every invoke")
    elif slot.calls == 0 and (above := skipped_above(slot, self.interleaver.skipped)):
        reason = (
            f"{path} is inside {above.label()}, which a body skipped with .skip() in this "
            "forward, so it never ran. Read it in a trace that does not skip "
            f"{above.label()}"
        )
    elif slot.calls == 0 and slot.elsewhere == slot.live.serial:
        reason = (
            f"{path} ran only on another thread (the forward handed it to a thread pool or "
            "a worker thread), and a trace counts and serves only the calls made on the "
            "thread that runs the forward. Read the module that hands the work over (its "
            ".input or .output), or make the model call it directly while you trace it"
        )
    elif slot.calls == 0:
        reason = never_ran(path, envoy, kind, self.interleaver)
    elif kind == "output" and slot.outs <= call < slot.calls:
        reason = (
            f"{path} began that call and raised before it returned (the model's own code "
            "caught the error and went on), so it has no output to read. Read its .input, or "
            "look for what makes it raise by calling it on that input"
        )
    elif call and not self.iter_depth:
        reason = (
            f"{path} ran only {slot.calls} time(s) in this forward, so call {call} never "
            "happened. After .next() (or tracer.next()) every later read of the body is at "
            "the next call: read this before the .next(), or step back with "
            "tracer.next(-1)"
        )
    else:
        reason = (
            f"{path} ran only {slot.calls} time(s) in this forward, so call {call} never "
            "happened (check tracer.iter indices)"
        )
    return MissedModuleError(f"{self.label()} waited for {what} at {where}, but {reason}.")


# ---- Interleaver.slot_of's: an Envoy the running trace has no slot for

def other_model_message(envoy) -> str:
    """Why an Envoy of another model than the trace's cannot be read in its body."""
    from .calls import traced_slot  # (calls.py imports mediator.py, which imports this)

    head = (f"{envoy._path} is not part of the model being traced here (at "
            f"{user_location()}): a body reads the values of the model of the innermost "
            "trace it is written in. ")
    wrapped = traced_slot(envoy._module.__dict__.get("forward"))
    if wrapped is not None and wrapped.live.inter is not None:  # its trace is open
        return head + (
            "A trace of that model is open around this one: read its values in that "
            "trace's body, outside this inner `with` block (a name bound there can be used "
            "in here).")
    return head + (
        "Read them in the body of a trace of that model, on a `with` line of its own (two "
        "traces opened in one `with` statement share one body, which belongs to the last "
        "of them).")

def moved_message(inter: "Interleaver", envoy) -> "str | None":
    """Why an Envoy of the model ``inter`` traces has no slot there, when its module was
    replaced or removed (None for an Envoy of another model)."""
    d = envoy.__dict__
    if inter.home is None or d.get("_tree") is not inter.home.get("_tree"):
        return None
    path, module = d["_path"], d["_module"]
    try:
        now = inter.root.get_submodule(d["_mpath"])
    except AttributeError:
        now = None
    where = user_location()
    if now is module:
        return (
            f"{path} ({type(module).__name__}) was put into the model after this trace "
            f"began, so the trace does not follow it (read at {where}). A trace follows the "
            "modules its model holds when it starts: replace modules before the trace, and "
            "read the new one in the next trace."
        )
    if now is not None:
        return (
            f"{path}, read at {where}, stands for the {type(module).__name__} that was at "
            f"that place before it was replaced (the model holds "
            f"{'another' if type(now) is type(module) else 'a'} {type(now).__name__} "
            f"there now). An Envoy kept from before the replacement keeps the old module: "
            f"read it through the model again ({path}) to reach the one there now."
        )
    return (
        f"{path} ({type(module).__name__}), read at {where}, is no longer part of the "
        "model: it was removed (or moved) after this Envoy was taken. Read the modules "
        "the model holds now, print(model) shows them."
    )
