"""``remote="local"`` (nnsight 0.5.16+): the block is shipped as to a cluster (pickled with the
values it reads), run by the server's code on this process's model, and answered back."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight
from nnsight_lite.errors import RemoteError
from nnsight_lite.remote.client import LocalBackend
from nnsight_lite.remote.execute import Deadline


def test_a_local_remote_trace_equals_plain_torch(seq):
    """Reads, an in-place edit and the output of a `remote="local"` trace equal the plain
    model's with the same edit; saved names are bound back, the unsaved are not."""
    model = NNsight(seq)
    x = torch.randn(3, 6)
    scale = 2.0  # a caller value the shipped block reads
    with model.trace(x, remote="local"):
        h = model[1].output.save()
        model[2].output[:] = model[2].output * scale
        unsaved = model[2].output.sum()  # noqa: F841
        out = model.output.save()
    h_want = seq[1](seq[0](x))
    torch.testing.assert_close(h, h_want)
    torch.testing.assert_close(out, seq[3](seq[2](h_want) * scale))
    assert "unsaved" not in locals()


def test_a_value_that_cannot_ship_fails_as_on_a_cluster(seq):
    """A block reading a value that cannot be pickled (a generator) raises RemoteError naming
    the block, as it would against a cluster; the model's forward never runs."""
    model = NNsight(seq)
    calls = []
    handle = seq.register_forward_hook(lambda m, i, o: calls.append(1))
    gen = (i for i in range(3))
    try:
        with pytest.raises(RemoteError, match="could not be pickled") as info:
            with model.trace(torch.randn(1, 6), remote="local"):
                first = next(gen)  # noqa: F841
    finally:
        handle.remove()
    assert calls == []
    assert "the one(s) that cannot: `gen` (a generator)" in str(info.value)


def test_a_saved_value_that_cannot_ship_back_is_named(seq):
    """A saved value the server cannot pickle back (a generator) gives RemoteError naming it
    and saying to save data; the saved tensor beside it is not named, nothing is bound."""
    model = NNsight(seq)
    with pytest.raises(RemoteError, match="could not be pickled to send back") as info:
        with model.trace(torch.randn(1, 6), remote="local"):
            fine = model[0].output.save()
            rows = nnsight_lite.save(r for r in model.output)
    msg = str(info.value)
    assert "the one(s) that cannot: `rows` (a generator). Save data instead" in msg
    assert "`fine`" not in msg
    assert "fine" not in locals() and "rows" not in locals()


def test_tracer_result_after_the_block_is_as_local(seq):
    """After a plain trace, `tracer.result` raises NNsightError both locally and with
    remote="local" (it is read in the body and saved); inside the body, saved, it equals the
    model's output."""
    from nnsight_lite.errors import NNsightError

    model = NNsight(seq)
    x = torch.randn(2, 6)
    errors = []
    for remote in (False, "local"):
        with model.trace(x, remote=remote) as tracer:
            out = tracer.result.save()
        torch.testing.assert_close(out, seq(x))
        with pytest.raises(NNsightError, match="only readable inside the trace's body") as info:
            tracer.result
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_a_cache_from_a_remote_trace_navigates_like_a_local_one(seq):
    """tracer.cache() saved by a remote="local" trace comes back attached to the model: the
    keys, cache[i], cache.model[i] and the path lookup equal the local run's and the plain
    modules' outputs."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    views = []
    for remote in (False, "local"):
        with model.trace(x, remote=remote) as tracer:
            cache = tracer.cache()
        views.append(cache)
    want = [x]
    for layer in seq:
        want.append(layer(want[-1]))
    for cache in views:
        assert list(cache.keys()) == ["model.0", "model.1", "model.2", "model.3", "model"]
        torch.testing.assert_close(cache[1].output, want[2])
        torch.testing.assert_close(cache.model[2].output, want[3])
        torch.testing.assert_close(cache["model.3"].output, want[4])


def test_a_trace_header_entering_python_after_a_time_limited_block_runs(seq):
    """A replica runs every request under its time limit (remote.execute.Deadline). Leaving
    such a block, whether the limit was reached or not, must leave this thread able to run
    `with model.trace(x), contextlib.nullcontext():`, whose nullcontext.__enter__ is entered
    while the trace's body skipper (a trace function) is set. Deadline used to cancel with
    PyThreadState_SetAsyncExc(thread, NULL), which on CPython 3.11 leaves the interpreter's
    async-exception flag raised: that __enter__ then spun in the eval loop (here, until the
    guarding Deadline(5) stopped it)."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    with Deadline(60):  # not reached
        pass
    with pytest.raises(RemoteError, match="time limit"):
        with Deadline(0.2):  # reached: a pure-Python loop is stopped
            while True:
                pass
    for _ in range(2):
        start = time.perf_counter()
        with Deadline(5):  # only a guard: this must end long before
            with model.trace(x), contextlib.nullcontext():
                h = model[1].output.save()
            with model.trace(x) as tracer, contextlib.ExitStack():
                out = tracer.result.save()
        assert time.perf_counter() - start < 4
        torch.testing.assert_close(h, seq[1](seq[0](x)))
        torch.testing.assert_close(out, seq(x))


@pytest.mark.parametrize("slow_exit", ["redirect_stderr", "redirect_stdout"])
def test_a_time_limit_passing_while_a_request_leaves_its_block_restores_the_replica(slow_exit):
    """The time limit passing while execute() leaves its with-statement: the stop was delivered
    inside whichever __exit__ ran then (Deadline was the outermost manager, so its timer still
    ran during the others' exits), which then never restored what it had changed: the replica
    kept sys.stderr (or sys.stdout) redirected to a finished request's buffer. A profile function sleeping at that __exit__'s call stands for a slow exit.
    Ground truth: the interpreter's streams (and the serving flag) as they were before."""
    import sys
    import threading

    from nnsight_lite.remote import hook
    from nnsight_lite.remote.execute import execute

    streams = sys.stdout, sys.stderr
    serving_before = getattr(hook._state, "serving", False)
    slowed = threading.Event()

    def profile(frame, event, arg):
        if event != "call" or frame.f_code.co_name != "__exit__" or slowed.is_set():
            return
        if type(frame.f_locals.get("self")).__name__ == slow_exit:
            slowed.set()
            time.sleep(0.5)  # past the request's time limit

    sys.setprofile(profile)
    try:
        reply = execute({"source": "x = 1\n", "filename": "<request>"}, {}, time_limit=0.2)
    finally:
        sys.setprofile(None)
        left = sys.stdout, sys.stderr, getattr(hook._state, "serving", False)
        sys.stdout, sys.stderr = streams
        hook._state.serving = serving_before
    assert slowed.is_set()
    assert left == (*streams, serving_before)
    assert reply["error"] is None or reply["error"]["qualname"] == "RemoteTimeoutError"


def test_a_source_view_held_outside_the_block_ships(seq):
    """A ``.source`` view (and one of its operations) bound before a remote block and used in
    it ships with the block: the server reads and edits the op of its own model. (The view
    keeps its operations weakly, which pickle cannot take: found by session 18's second
    review, where a fix made them weak.)"""

    class Act(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x):
            return torch.relu(self.lin(x))

    torch.manual_seed(0)
    net = Act()
    model = NNsight(net)
    x = torch.randn(3, 6)
    src = model.source
    relu = src.torch_relu_0
    with model.trace(x, remote="local"):
        h = src.self_lin_0.output.save()
        r = relu.output.clone().save()
        relu.output[:] = 1.0
        out = model.output.save()
    torch.testing.assert_close(h, net.lin(x))
    torch.testing.assert_close(r, torch.relu(net.lin(x)))
    torch.testing.assert_close(out, torch.ones(3, 6))


def test_a_served_name_without_a_cluster_says_to_connect(tmp_path):
    """A block sent to a served model by name (backend="...") in a process that never joined a
    Ray cluster raises RemoteError saying to connect first. It said the process was "no longer
    connected to a Ray cluster (ray.shutdown() ran)", which it never was; nothing is started.
    (Run in a fresh process: the suite's remote tests leave this one joined to their cluster.)"""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    pytest.importorskip("ray")
    script = tmp_path / "served_name.py"
    script.write_text(textwrap.dedent("""
        import re
        import ray
        import torch
        from nnsight_lite import NNsight, RemoteError

        torch.manual_seed(0)
        seq = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.ReLU())
        model = NNsight(seq)
        x = torch.randn(2, 6)
        try:
            with model.trace(x, backend="nowhere"):
                out = model.output.save()
        except RemoteError as err:
            text = str(err)
        else:
            raise SystemExit("no RemoteError")
        assert re.search(r"the block at .*served_name\\.py:\\d+ was to run on model 'nowhere', "
                         r"but this process is not connected to a Ray cluster.*connect\\(address\\)",
                         text, re.S), text
        assert "no longer" not in text, text
        assert not ray.is_initialized()
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))
        print("ok")
    """))
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_a_request_gets_no_note_about_another_requests_block(seq):
    """The note on a name an earlier block dropped unsaved looks for blocks of another cell of
    the same top-level namespace, known by the id() of its globals. A served model runs each
    request at the top level of a fresh dict, and a later request's dict often has the id of
    an earlier, freed one: Bob's NameError got a note naming Alice's file and block. Each
    request is its own namespace (names never carry over), so no request's note may name
    another's block. Ground truth: a NameError with no note, as plain Python gives."""
    import pickle

    from nnsight_lite.remote.execute import execute

    model = NNsight(seq)
    x = torch.randn(2, 6)
    ids: list = []
    alice = "ids.append(id(globals()))\nwith model.trace(x):\n    h = model[1].output\n"
    bob = "ids.append(id(globals()))\nwith model.trace(x):\n    model[1].output[:] = h\n"
    alices, reused = set(), 0  # (reused: how often the bug's condition came up)
    for i in range(200):  # (Bob's dict gets the id one of Alice's had every few requests)
        first = execute({"source": alice + f"# edit {i}\n", "filename": "/home/alice/a.py"},
                        {"model": model, "x": x, "ids": ids})
        alices.add(ids.pop())
        reply = execute({"source": bob, "filename": "/home/bob/b.py"},
                        {"model": model, "x": x, "ids": ids})
        assert first["error"] is None
        assert reply["error"]["qualname"] == "NameError"
        err = pickle.loads(reply["error"]["pickled"])
        assert getattr(err, "__notes__", []) == [], err.__notes__
        reused += ids.pop() in alices
    # (where no dict happened to get a freed one's id in this run: nothing is recorded under
    # the id of a request's globals once it ended, which is what a later request could match)
    from nnsight_lite.capture.body import top_blocks

    assert not [key for key in top_blocks if key[0] in alices]


def _look_up(table, key):
    return table[key]  # the helper's line: both tracebacks end here


def _user_frames(exc):
    import traceback

    return [(f.filename, f.lineno, f.name) for f in traceback.extract_tb(exc.__traceback__)
            if f.filename == __file__]


def test_a_remote_error_has_the_local_arguments_and_traceback(seq):
    """An exception from a remote body arrives as it does locally: the same type and the same
    arguments (a KeyError's key was the key plus " (remote body, file:line)"), and a traceback
    through the user's lines, the body's line and the helper it called (it stopped at the
    with-statement, the line in the message only). Ground truth: plain Python's KeyError and
    the same block run locally."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    errors = []
    for kw in ({}, {"remote": "local"}):
        with pytest.raises(KeyError) as info:
            with model.trace(x, **kw):
                h = model[1].output
                _look_up({"kept": h}, "gone")
        errors.append(info.value)
    local, remote = errors
    with pytest.raises(KeyError) as plain:
        _look_up({}, "gone")
    assert remote.args == local.args == plain.value.args == ("gone",)
    assert _user_frames(remote) == _user_frames(local)
    assert [name for _, _, name in _user_frames(local)][-1] == "_look_up"
    assert any(n.startswith("remote traceback") for n in remote.__notes__)


class _Scaled(torch.nn.Module):
    """A module whose forward hands itself to a function: `.source`'s `_scale_0` operation's
    first argument is the module."""

    def __init__(self, width=256):
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x):
        return _scale(self, self.lin(x))


def _scale(module, x):
    return x * 2 + module.lin.bias


def test_a_module_of_the_model_in_saved_values_comes_back_as_itself(seq):
    """A saved value holding one of the model's modules (a source operation's `self`
    argument) comes back as the client's module at that path, as locally, not as a pickled
    copy carrying its weights (256 KB here). Ground truth: the module object itself, and the
    plain forward for the saved output."""
    torch.manual_seed(0)
    net = _Scaled()
    model = NNsight(net)
    x = torch.randn(2, 256)
    backend = LocalBackend()
    with model.trace(x, backend=backend):
        args, _ = model.source._scale_0.inputs
        args = nnsight_lite.save(args)
        out = model.output.save()
    assert args[0] is net
    torch.testing.assert_close(out, net(x), rtol=0, atol=0)
    weights = sum(p.numel() * p.element_size() for p in net.parameters())
    assert backend.last_received < weights // 4


def test_a_remote_error_keeps_the_exception_it_was_raised_from(seq):
    """`raise ValueError(...) from err` in a remote body: the client's exception has the same
    __cause__ (type, arguments, the user's line) and __context__ as locally; the replica
    dropped both. Ground truth: the same block run locally."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    errors = []
    for kw in ({}, {"remote": "local"}):
        with pytest.raises(ValueError, match="wrapped") as info:
            with model.trace(x, **kw):
                h = model[1].output
                try:
                    _look_up({"kept": h}, "gone")
                except KeyError as err:
                    raise ValueError("wrapped") from err
        errors.append(info.value)
    local, remote = errors
    assert type(remote.__cause__) is type(local.__cause__) is KeyError
    assert remote.__cause__.args == local.__cause__.args == ("gone",)
    assert remote.__context__ is remote.__cause__ and remote.__suppress_context__
    assert _user_frames(remote.__cause__) == _user_frames(local.__cause__)
    assert _user_frames(remote) == _user_frames(local)


def test_exit_in_a_remote_body_reaches_the_client_as_locally(seq):
    """`raise SystemExit(3)` (what exit() and sys.exit(3) raise) in a remote body: the client
    gets SystemExit(3) with the user's line last in its traceback, as locally. The server let
    it pass (it is no Exception): here it skipped the reply, on a replica it stopped the
    serving loop. Ground truth: the same block run locally."""
    model = NNsight(seq)
    errors = []
    for kw in ({}, {"remote": "local"}):
        with pytest.raises(SystemExit) as info:
            with model.trace(torch.randn(2, 6), **kw):
                if model[1].output.shape[0] == 2:
                    raise SystemExit(3)
        errors.append(info.value)
    local, remote = errors
    assert remote.args == local.args == (3,)
    assert _user_frames(remote) == _user_frames(local)
    assert "raise SystemExit" in __import__("traceback").extract_tb(remote.__traceback__)[-1].line


def test_a_saved_slice_sends_its_own_bytes_not_the_whole_tensor(seq):
    """A saved view of a big activation (one row of the output of a 4096-row batch, as
    `logits[:, -1]` is of the logits) comes back as that row's bytes: the pickled view wrote
    the whole storage (96 KB here), so a 4 KB byte cap refused a 24-byte value. Two saved
    names for one view stay one object. Ground truth: the plain forward."""
    model = NNsight(seq)
    x = torch.randn(4096, 6)
    backend = LocalBackend()
    backend.max_bytes = 4096
    with model.trace(x, backend=backend):
        row = model.output[7].save()
        same = nnsight_lite.save([row, row])
    want = seq(x)
    torch.testing.assert_close(row, want[7], rtol=0, atol=0)
    assert same[0] is same[1] is row
    assert row.untyped_storage().nbytes() == row.numel() * row.element_size()


def test_a_remote_trace_in_a_local_session_reads_the_callers_names_and_saves(seq):
    """A remote trace nested in a local session's body: it reads the caller's names through
    the session's namespace (none were shipped: NameError on the server for `model`), and
    what it saves is saved in the session too, so a later local trace there uses it and it
    is bound after the session (it was dropped). Ground truth: the plain modules."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    with model.session():
        with model.trace(x, remote="local"):
            h = model[1].output.save()
        with model.trace(x):
            model[1].output[:] = h * 2
            out = model.output.save()
    h_want = seq[1](seq[0](x))
    torch.testing.assert_close(h, h_want, rtol=0, atol=0)
    torch.testing.assert_close(out, seq[3](seq[2](h_want * 2)), rtol=0, atol=0)


def test_a_backward_between_remotely_saved_tensors_says_to_run_it_remotely(seq):
    """Locally, a backward after the trace from one saved tensor to another works (they share
    a graph); tensors a remote trace saved arrive as separate leaves, so the same code cannot
    reach `h`: the GradientError says why and what to do (it said to check the loss is
    computed from it, which the user's code does). Ground truth: the local run's gradient
    equals autograd's on the plain modules."""
    from nnsight_lite.errors import GradientError

    model = NNsight(seq)
    x = torch.randn(2, 6)
    with model.trace(x):
        h = model[1].output.save()
        out = model.output.save()
    with out.sum().backward():
        g = h.grad.save()
    h_ref = seq[1](seq[0](x)).detach().requires_grad_(True)
    seq[3](seq[2](h_ref)).sum().backward()
    torch.testing.assert_close(g, h_ref.grad)
    with model.trace(x, remote="local"):
        h = model[1].output.save()
        out = model.output.save()
    assert h.requires_grad and h.is_leaf
    with pytest.raises(GradientError, match="came back from a remote trace.*stayed on the "
                       r"server. Run the backward in the remote trace's body"):
        with out.sum().backward():
            h.grad.save()


class _Mismatch(Exception):
    """An exception with an __init__ of its own: its pickle (class and args) cannot rebuild it."""

    def __init__(self, got, want):
        super().__init__(f"got {got}, want {want}")
        self.got, self.want = got, want


def test_an_exception_with_its_own_init_arrives_as_its_type(seq):
    """A body raising an exception class whose __init__ takes other arguments than its
    message: the client gets that class, with the local args and attributes (it got a
    RemoteError naming the class: unpickling called __init__ with the message alone).
    Ground truth: the same block run locally."""
    model = NNsight(seq)
    errors = []
    for kw in ({}, {"remote": "local"}):
        with pytest.raises(_Mismatch) as info:
            with model.trace(torch.randn(2, 6), **kw):
                rows = model[1].output.shape[0]
                raise _Mismatch(rows, 3)
        errors.append(info.value)
    local, remote = errors
    assert type(remote) is type(local) is _Mismatch
    assert remote.args == local.args == ("got 2, want 3",)
    assert (remote.got, remote.want) == (local.got, local.want) == (2, 3)
    assert _user_frames(remote) == _user_frames(local)


def test_warnings_of_a_local_remote_trace_are_the_local_ones(seq):
    """A `remote="local"` body's warnings (its own and torch's) are issued as the same body
    issues them run locally: category, message, file, line, once per place under the default
    filter; a category the client cannot import arrives as a UserWarning naming it."""
    import warnings

    model = NNsight(seq)
    x = torch.randn(3, 6)

    class Odd(UserWarning):  # (defined here: the shipped body gets it by value)
        pass

    def run(**kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            with model.trace(x, **kw):
                for _ in range(2):
                    warnings.warn(f"rows {model[1].output.shape[0]}", Odd)
                torch.nn.functional.softmax(model[2].output)  # (torch warns: no dim given)
        return [(w.category, str(w.message), w.filename, w.lineno) for w in caught]

    local = run()
    assert [c for c, *_ in local] == [Odd, UserWarning] and local[0][1:3] == ("rows 3", __file__)
    remote = run(remote="local")
    assert remote[1:] == local[1:]
    # (Odd is local to this test: no module attribute names it, as for a class of the
    # replica's that the client does not have)
    assert remote[0] == (UserWarning, f"{__name__}.{Odd.__qualname__}: rows 3", *local[0][2:])


def test_a_library_warning_of_a_local_remote_trace_is_filtered_by_its_module(
        seq, tmp_path, monkeypatch):
    """A warning raised in another module's code (at its own line, stacklevel 1) is issued on
    the client from that module's file and under its name, so a filter on the module applies
    as it does locally."""
    import importlib
    import sys
    import warnings

    (tmp_path / "noisy_lib.py").write_text(
        "import warnings\n\ndef noisy(n):\n    warnings.warn(f'noisy {n}')\n    return n\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    noisy_lib = importlib.import_module("noisy_lib")
    model = NNsight(seq)
    x = torch.randn(3, 6)

    def run(ignore, **kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if ignore:
                warnings.filterwarnings("ignore", module="noisy_lib")
            with model.trace(x, **kw):
                noisy_lib.noisy(model[1].output.shape[0])
        return [(w.category, str(w.message), w.filename, w.lineno) for w in caught]

    try:
        local = run(False)
        assert local == [(UserWarning, "noisy 3", noisy_lib.__file__, 4)]
        assert run(False, remote="local") == local
        assert run(True) == run(True, remote="local") == []
    finally:
        sys.modules.pop("noisy_lib", None)


class _Measured(UserWarning):
    """A warning category whose constructor takes other arguments than a message."""

    def __init__(self, got, want):
        super().__init__(f"got {got}, want {want}")
        self.got, self.want = got, want


def test_a_warning_category_with_its_own_init_is_issued_as_locally(seq):
    """A body's warning whose category's ``__init__`` takes other arguments (a warning instance
    passed to ``warnings.warn``) is issued on the client with that category, message, file and
    line, and raised as that category under an 'error' filter, as the same body does locally
    (warn_again raised TypeError: the category called with the message alone)."""
    import warnings

    model = NNsight(seq)
    x = torch.randn(3, 6)

    def run(action, **kw):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter(action)
            with model.trace(x, **kw):
                warnings.warn(_Measured(model[1].output.shape[0], 4))
                out = model.output.save()
        return out, [(w.category, str(w.message), w.filename, w.lineno) for w in caught]

    out, local = run("always")
    assert local == [(_Measured, "got 3, want 4", __file__, local[0][3])]
    remote_out, remote = run("always", remote="local")
    assert remote == local
    torch.testing.assert_close(remote_out, out)
    for kw in ({}, {"remote": "local"}):
        with pytest.raises(_Measured, match="^got 3, want 4$"):
            run("error", **kw)


def test_local_remote_traces_on_two_threads_leave_no_redirect_behind(seq, tmp_path, monkeypatch):
    """Two threads' ``remote="local"`` traces of separate models, the second entered while the
    first runs and ending after it: the prints come out, the values equal the plain models',
    and sys.stdout, sys.stderr and warnings.showwarning are the process's own afterwards (each
    request swapped them in turn, so the later one to end put back the earlier one's capture:
    every later print and warning of the process went there). Requests here take turns, as on
    a replica's one serving thread. (Which thread shows the first's warning is not checked:
    it may be issued while the second request runs, which captures the process's warnings.)"""
    import copy
    import importlib
    import io
    import sys
    import threading
    import warnings

    (tmp_path / "sync_s22.py").write_text(  # (a module the bodies reach by reference:
        "import threading\n"                 # events cannot be pickled)
        "a_in, b_in, a_done = threading.Event(), threading.Event(), threading.Event()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sync = importlib.import_module("sync_s22")
    models = [NNsight(seq), NNsight(copy.deepcopy(seq))]
    x = torch.randn(3, 6)
    results: dict = {}

    def first():
        model = models[0]
        with model.trace(x, remote="local"):
            sync.a_in.set()
            sync.b_in.wait(1)  # (the second runs meanwhile where requests do not take turns)
            print("first")
            warnings.warn("first")
            out = model.output.save()
        sync.a_done.set()
        results["first"] = out

    def second():
        model = models[1]
        sync.a_in.wait(5)
        with model.trace(x, remote="local"):
            sync.b_in.set()
            sync.a_done.wait(5)
            print("second")
            out = model.output.save()
        results["second"] = out

    out = io.StringIO()
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    with warnings.catch_warnings():  # (set here: a thread's own would race the requests')
        warnings.simplefilter("ignore", UserWarning)
        before = (sys.stdout, sys.stderr, warnings.showwarning)
        try:
            with contextlib.redirect_stdout(out):
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(20)
            after = (sys.stdout, sys.stderr, warnings.showwarning)
        finally:
            sys.stdout, sys.stderr, warnings.showwarning = before
            sys.modules.pop("sync_s22", None)
    assert after == before
    assert sorted(out.getvalue().split()) == ["first", "second"]
    torch.testing.assert_close(results["first"], seq(x))
    torch.testing.assert_close(results["second"], seq(x))


class _Gate:
    """A value whose pickling waits (up to a second) for ``go``, having set ``started``."""

    def __init__(self, started, go):
        self.started, self.go = started, go

    def __reduce__(self):
        self.started.set()
        self.go.wait(1)
        return int, (0,)


def test_a_module_registered_while_another_thread_ships_stays_registered(seq):
    """nnsight_lite.register(module) called while another thread's trace is being pickled
    with that module sent by value for the moment (the with-statement's own module) keeps the
    registration: the shipping thread let go of it when done, which dropped the user's."""
    import sys
    import threading

    import cloudpickle

    model = NNsight(seq)
    x = torch.randn(3, 6)
    started, go = threading.Event(), threading.Event()
    gate = _Gate(started, go)
    results = {}

    def ship():
        with model.trace(x, remote="local"):
            g = gate  # noqa: F841 - read by the body, so pickled with it
            out = model.output.save()
        results["out"] = out

    def register():
        started.wait(5)
        nnsight_lite.register(__name__)
        go.set()

    me = sys.modules[__name__]
    assert __name__ not in cloudpickle.list_registry_pickle_by_value()
    threads = [threading.Thread(target=ship), threading.Thread(target=register)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert __name__ in cloudpickle.list_registry_pickle_by_value()
    finally:
        if __name__ in cloudpickle.list_registry_pickle_by_value():
            cloudpickle.unregister_pickle_by_value(me)
    torch.testing.assert_close(results["out"], seq(x))


def test_a_replica_keeps_a_warning_repeated_in_a_loop_once():
    """While a request runs, the replica keeps each distinct warning once (it kept every one
    issued: ~90 bytes each for a warning in a long loop, until the request ended)."""
    import warnings

    from nnsight_lite.remote.execute import kept_warnings

    caught: list = []
    with kept_warnings(caught):
        for _ in range(1000):
            warnings.warn("same")
        for i in range(3):
            warnings.warn(f"other {i}", FutureWarning)
    assert [(c, m) for _, c, m, _, _ in caught] == [
        (UserWarning, "same"), (FutureWarning, "other 0"), (FutureWarning, "other 1"),
        (FutureWarning, "other 2")]
