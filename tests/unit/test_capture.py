"""Where a body can sit: module, function, method, closure, loop, class body, exec, IPython."""

from __future__ import annotations

import linecache
import re
import sys
import runpy
import textwrap

import pytest
import torch

import nnsight_lite
from nnsight_lite import NNsight, SourceUnavailableError
from nnsight_lite.errors import BodySyntaxError


_GLOBAL_OFFSET = -100.0  # (shadowed by a local in test_function_names_of_every_kind)
_GLOBAL_SHIFTS = (1.0, 2.0)


@pytest.fixture
def model(seq):
    return NNsight(seq)


def expected(seq, x, upto):
    h = x
    for i in range(upto + 1):
        h = seq[i](h)
    return h


class TestPlacesABodyCanSit:
    def test_module_level(self, tmp_path, seq):
        path = tmp_path / "script.py"
        path.write_text(textwrap.dedent("""
            import torch
            from nnsight_lite import NNsight
            model = NNsight(SEQ)
            x = X
            with model.trace(x):
                h = model[1].output.save()
                junk = model[2].output
        """))
        x = torch.randn(2, 6)
        ns = runpy.run_path(str(path), init_globals={"SEQ": seq, "X": x})
        torch.testing.assert_close(ns["h"], expected(seq, x, 1))
        assert "junk" not in ns

    def test_function_with_closure(self, model, seq):
        x = torch.randn(2, 6)
        factor = 3.0

        def outer():
            def inner():
                with model.trace(x):
                    h = (model[0].output * factor).save()
                return h
            return inner()

        torch.testing.assert_close(outer(), expected(seq, x, 0) * 3.0)

    def test_function_names_of_every_kind(self, model, seq):
        """A body in a function reads its locals (one shadowing a module global), a cell it
        shares with a nested function, a free variable, module globals and builtins, and
        each resolves as the function's own code would resolve it (3.13+ asks the frame's
        FrameLocalsProxy for the function's variables only)."""
        x = torch.randn(2, 6)
        scale = 2.0

        def f():
            expected_fn = lambda: len(_GLOBAL_SHIFTS)  # noqa: E731  (makes `expected_fn` a local)
            _GLOBAL_OFFSET = 10.0  # a local shadowing the module global of that name
            shared = 0.5  # a cell: the nested function reads it

            def nested():
                return shared

            with model.trace(x):
                h = (model[0].output * scale + _GLOBAL_OFFSET + nested()
                     + sum(_GLOBAL_SHIFTS) + expected_fn()).save()
            return h

        want = expected(seq, x, 0) * 2.0 + 10.0 + 0.5 + sum(_GLOBAL_SHIFTS) + len(_GLOBAL_SHIFTS)
        torch.testing.assert_close(f(), want)

    def test_method(self, model, seq):
        x = torch.randn(2, 6)

        class Probe:
            def __init__(self, m):
                self.m = m

            def run(self, inp):
                with self.m.trace(inp):
                    out = self.m[2].output.save()
                return out

        torch.testing.assert_close(Probe(model).run(x), expected(seq, x, 2))

    def test_loop(self, model, seq):
        xs = [torch.randn(2, 6) for _ in range(3)]
        got = []
        for x in xs:
            with model.trace(x):
                h = model[3].output.save()
            got.append(h)
        for x, h in zip(xs, got):
            torch.testing.assert_close(h, seq(x))

    def test_class_statement_inside_a_body(self, model, seq):
        """A class defined in a body sees the caller's names and module globals (torch) in its
        own body, decorators, defaults, comprehensions and nested classes."""
        x = torch.randn(2, 6)
        k = 3
        with model.trace(x):
            h = model[0].output

            class Probe:
                zeros = torch.zeros(k)
                doubled = h * 2
                count = len([k for _ in range(2)])

                @torch.no_grad()
                def ones(self, n=k):
                    return torch.ones(n)

                class Inner:
                    kk = k + 1

            nnsight_lite.save(Probe)
        torch.testing.assert_close(Probe.zeros, torch.zeros(3))
        torch.testing.assert_close(Probe.doubled, expected(seq, x, 0) * 2)
        assert Probe.count == 2 and Probe.Inner.kk == 4
        torch.testing.assert_close(Probe().ones(), torch.ones(3))

    def test_a_class_made_in_a_body_belongs_to_the_callers_module(self, model, seq):
        """A class (a dataclass too) made in a body has the __module__ the same statement
        gives it outside the body: the caller's module (it was 'builtins': the class statement
        reads __name__ from the globals dict itself, which never asks the caller's names), so
        its repr, pickling by reference and dataclass machinery see the right module."""
        import dataclasses

        class Outside:
            pass

        with model.trace(torch.randn(2, 6)):

            @dataclasses.dataclass
            class Record:
                rows: int

            class Plain:
                pass

            got = nnsight_lite.save((Record.__module__, Plain.__module__, repr(Record(2))))
            name = nnsight_lite.save(__name__)
        assert got[:2] == (Outside.__module__, Outside.__module__) == (__name__, __name__)
        assert name == __name__ and got[2].endswith("Record(rows=2)")

    def test_class_body(self, model, seq):
        x = torch.randn(2, 6)

        class Holder:
            with model.trace(x):
                h = model[0].output.save()

        torch.testing.assert_close(Holder.h, expected(seq, x, 0))

    def test_a_function_declaring_a_name_global(self, model, seq):
        """``global acts`` in the function around the block: the saved value is bound in the
        module, as plain Python binds it there (it was dropped silently); the function's own
        locals and a nonlocal beside it are written back as before."""
        x = torch.randn(2, 6)
        ns = {"model": model, "x": x, "acts": None}
        src = textwrap.dedent("""
            def collect():
                global acts
                last = None
                with model.trace(x):
                    acts = model[0].output.save()
                    mine = model[1].output.save()
                def inner():
                    nonlocal last
                    with model.trace(x):
                        last = model[2].output.save()
                inner()
                return mine, last
        """)
        filename = "<global-snippet>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        try:
            exec(compile(src, filename, "exec"), ns)
            mine, last = ns["collect"]()
        finally:
            linecache.cache.pop(filename, None)
        torch.testing.assert_close(ns["acts"], expected(seq, x, 0))
        torch.testing.assert_close(mine, expected(seq, x, 1))
        torch.testing.assert_close(last, expected(seq, x, 2))

    def test_names_written_back_overwrite_locals(self, model, seq):
        x = torch.randn(2, 6)
        h = "before"
        with model.trace(x):
            h = model[0].output.save()
        assert isinstance(h, torch.Tensor)

    def test_exec_with_linecache_source(self, model, seq):
        x = torch.randn(2, 6)
        src = "with model.trace(x):\n    h = model[1].output.save()\n"
        filename = "<registered-snippet>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        try:
            ns = {"model": model, "x": x}
            exec(compile(src, filename, "exec"), ns)
        finally:
            linecache.cache.pop(filename, None)
        torch.testing.assert_close(ns["h"], expected(seq, x, 1))

    def test_exec_without_source_raises(self, model):
        """Invokes need their source: exec of a bare string with them raises, saying why."""
        src = ("with model.trace() as tr:\n    with tr.invoke(x):\n"
               "        h = model[1].output.save()\n")
        ns = {"model": model, "x": torch.randn(2, 6)}
        with pytest.raises(SourceUnavailableError, match="no source for '<string>'.*Jupyter"):
            exec(compile(src, "<string>", "exec"), ns)

    def test_entered_without_a_with_statement(self, model, seq):
        """``model.trace(x).__enter__()`` (no with-statement) says to use a with-statement (the
        error nnsight 0.8 names WithBlockNotFoundError), not that the file was edited; nothing
        is left on the model."""
        from tests.strategies import leftovers

        x = torch.randn(2, 6)
        tracer = model.trace(x)
        with pytest.raises(nnsight_lite.WithBlockNotFoundError,
                           match=r"`\.\.\.trace\(\.\.\.\)` was entered at .*test_capture\.py:\d+ "
                                 r"by calling __enter__\(\) directly.*`with \.\.\.trace"):
            tracer.__enter__()
        assert leftovers(seq) == []
        with model.trace(x):
            out = model.output.save()
        torch.testing.assert_close(out, seq(x))

    def test_ipython_cell(self, seq):
        IPython = pytest.importorskip("IPython")
        from IPython.core.interactiveshell import InteractiveShell

        shell = InteractiveShell.instance()
        try:
            x = torch.randn(2, 6)
            shell.user_ns.update(model=NNsight(seq), x=x)
            result = shell.run_cell(
                "with model.trace(x):\n    h = model[2].output.save()\n    tmp = model[3].output\n"
            )
            result.raise_error()
            torch.testing.assert_close(shell.user_ns["h"], expected(seq, x, 2))
            assert "tmp" not in shell.user_ns
        finally:
            InteractiveShell.clear_instance()


class TestBodySyntax:
    def test_return_in_body(self, model):
        x = torch.randn(2, 6)

        def f():
            with model.trace(x):
                return model[0].output

        with pytest.raises(BodySyntaxError, match="`return` cannot appear"):
            f()

    def test_the_location_is_given_once(self, model):
        """str() of a BodySyntaxError names the file and line once (SyntaxError's own suffix)
        and the with-block's first line; the message carried its own copy of the location
        too. The error's filename and lineno are the offending statement's."""
        x = torch.randn(2, 6)

        def f():
            with model.trace(x):
                return model[0].output  # the bad line

        with pytest.raises(BodySyntaxError) as info:
            f()
        text = str(info.value)
        line = f.__code__.co_firstlineno + 2
        assert text.endswith(f"; the `with` block starts at line {line - 1} "
                             f"(test_capture.py, line {line})"), text
        assert len(re.findall(r"line \d+", text)) == 2 and __file__ not in text
        assert (info.value.filename, info.value.lineno) == (__file__, line)
        with pytest.raises(BodySyntaxError) as info:
            with model.trace(x): h = model[0].output.save()  # noqa: E701,F841
        text = str(info.value)
        assert text.endswith(f"(test_capture.py, line {info.value.lineno})"), text
        assert len(re.findall(r"line \d+", text)) == 1 and __file__ not in text

    def test_nonlocal_in_a_function_defined_in_the_body(self, model):
        """`nonlocal` on a body's name (or the enclosing function's) in a function defined in
        the body cannot compile: the error says why and to use a mutable object; it said only
        "no binding for nonlocal 'cnt' found", as if the user's code were wrong."""
        x = torch.randn(2, 6)

        def own():
            with model.trace(x):
                cnt = 0

                def bump():
                    nonlocal cnt
                    cnt += 1

        def enclosing():
            n = 0
            with model.trace(x):
                def bump():
                    nonlocal n
                    n += 1

        for f, name in ((own, "cnt"), (enclosing, "n")):
            with pytest.raises(BodySyntaxError, match=rf"^`nonlocal {name}` in a function defined "
                               rf"in a `with \.\.\.trace\(\.\.\.\)` body finds no variable to "
                               rf"bind: .*mutable object instead \({name} = \[0\] \.\.\. "
                               rf"{name}\[0\] \+= 1\)"):
                f()

    def test_yield_in_body(self, model):
        x = torch.randn(2, 6)

        def g():
            with model.trace(x):
                yield model[0].output

        with pytest.raises(BodySyntaxError, match="`yield` cannot appear"):
            next(g())

    def test_body_on_with_line(self, model):
        x = torch.randn(2, 6)
        with pytest.raises(BodySyntaxError, match="on its own indented lines"):
            with model.trace(x): h = model[0].output.save()  # noqa: E701,F841


def test_piped_stdin_has_no_source():
    """Code piped into `python -` has no source to read: a trace with invokes gives a clear
    error, not a hang (a single-input trace runs in place: test_no_source.py)."""
    import subprocess
    import sys

    code = textwrap.dedent("""
        import torch
        from nnsight_lite import NNsight
        model = NNsight(torch.nn.Linear(2, 2))
        with model.trace() as tracer:
            with tracer.invoke(torch.randn(1, 2)):
                h = model.output.save()
    """)
    proc = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "NoSourceError" in proc.stderr  # a SourceUnavailableError
    assert "no source for '<stdin>'" in proc.stderr and "Jupyter" in proc.stderr


def test_with_header_spanning_lines(seq):
    """The `as` name is bound before the body runs even when the header spans several lines."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    with model.trace(
        x,
    ) as tracer:
        same = nnsight_lite.save([tracer is not None])
        h = model[0].output.save()
    assert same == [True]
    torch.testing.assert_close(h, seq[0](x))


class _Recorder:
    """A plain context manager: its block must run as written inside a body."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("enter")
        return self

    def __exit__(self, *exc):
        self.log.append("exit")
        return False


class TestWithBlocksInsideBodies:
    """A with-block inside a body: nnsight_lite contexts (invoke, backward, a nested trace)
    run their blocks later themselves; any other context manager's block runs in place."""

    def test_other_context_managers_run_their_blocks(self, model, seq):
        x = torch.randn(2, 6)
        log = nnsight_lite.save([])
        with model.trace(x):
            with _Recorder(log):
                log.append("block")
                with torch.no_grad():
                    h = model[1].output.save()
            with _Recorder(log) as r1, _Recorder(log):
                log.append(r1 is not None)
        assert log == ["enter", "block", "exit", "enter", "enter", True, "exit", "exit"]
        torch.testing.assert_close(h, expected(seq, x, 1))

    def test_nested_contexts_run_their_blocks_once(self, model, seq):
        x = torch.randn(2, 6)
        other = NNsight(torch.nn.Linear(6, 6))
        log = nnsight_lite.save([])
        with model.trace() as tracer:
            with tracer.invoke(x):
                log.append("invoke")
                h = model[1].output.save()
                with other.trace(h):
                    log.append("nested")
                    o = other.output.save()
        assert log == ["invoke", "nested"]
        torch.testing.assert_close(o, other._module(expected(seq, x, 1)))

    def test_a_second_item_whose_enter_has_a_with_block(self, model, seq):
        """``with model.trace(x), cm:`` in a body, where ``cm.__enter__`` (also defined in a
        body) runs a with-block of its own: that block runs, and the trace's block is the one
        skipped and run by the trace."""
        x = torch.randn(2, 6)
        with model.session():
            class Starter:
                def __enter__(self):
                    with torch.no_grad():
                        self.started = True
                    return self

                def __exit__(self, *exc):
                    return False

            starter = Starter()
            with model.trace(x), starter:
                out = model.output.save()
            started = nnsight_lite.save([getattr(starter, "started", False)])
        assert started == [True]
        torch.testing.assert_close(out, expected(seq, x, 3))

    def test_two_invokes_entering_contexts_at_interleaved_times(self, model, seq):
        """Invoke 0 enters a nested trace, then waits for a module value while evaluating the
        next item of the same with-statement; invoke 1 enters its own nested trace meanwhile.
        Each block is skipped and run by its own trace."""
        x = torch.randn(2, 6)
        other = NNsight(torch.nn.Linear(6, 6))
        with model.trace() as tracer:
            with tracer.invoke(x):
                with other.trace(x), _Recorder([]) if model[1].output is not None else None:
                    o0 = other.output.save()
            with tracer.invoke(x):
                h = model[0].output
                with other.trace(h):
                    o1 = other.output.save()
        torch.testing.assert_close(o0, other._module(x))
        torch.testing.assert_close(o1, other._module(expected(seq, x, 0)))

    def test_with_in_a_function_defined_in_a_body_works_after_it(self, model, seq):
        x = torch.randn(2, 6)
        with model.trace(x):
            h = model[0].output.save()

            def double(t, log):
                with _Recorder(log):
                    return t * 2

            nnsight_lite.save(double)
        log = []
        torch.testing.assert_close(double(h, log), expected(seq, x, 0) * 2)
        assert log == ["enter", "exit"]
        # and a trace opened in it later, from plain code, still skips and runs its block
        def traced(t):
            with model.trace(t):
                out = model[0].output.save()
            return out

        torch.testing.assert_close(traced(x), expected(seq, x, 0))

    def test_failing_enter_of_an_inner_context_leaves_nothing(self, model):
        x = torch.randn(2, 6)

        class Broken:
            def __enter__(self):
                raise RuntimeError("enter failed")

            def __exit__(self, *exc):
                return False

        with pytest.raises(RuntimeError, match="enter failed"):
            with model.trace() as tracer:
                with tracer.invoke(x), Broken():
                    model[0].output.save()
        # the skip flag of that invoke must not leak into the next with-block in a body
        log = nnsight_lite.save([])
        with model.trace(x):
            with _Recorder(log):
                log.append("block")
        assert log == ["enter", "block", "exit"]


class TestBodiesStartingWithTry:
    """Python 3.11+ compiles a with-body's leading ``try:`` line outside every exception handler;
    bodies in user code that start with one must still run (once), or be refused clearly."""

    def test_try_except_first(self, model, seq):
        x = torch.randn(2, 6)
        with model.trace(x):
            try:
                try:
                    out = model[3].output.save()
                except Exception:  # must not catch the skip
                    raise
            except ZeroDivisionError:
                pass
        torch.testing.assert_close(out, expected(seq, x, 3))

    def test_context_suppressing_exceptions_beside_the_trace(self, model, seq):
        import contextlib

        x = torch.randn(2, 6)
        with model.trace(x), contextlib.suppress(Exception):
            out = model[3].output.save()
        torch.testing.assert_close(out, expected(seq, x, 3))

    def test_try_finally_first(self, model, seq):
        import sys

        x = torch.randn(2, 6)
        log = []
        if sys.version_info >= (3, 11):
            with pytest.raises(BodySyntaxError, match="`pass` will do"):
                with model.trace(x):
                    try:
                        out = model[3].output.save()
                    finally:
                        log.append("finally")
            assert log == []
        with model.trace(x):
            pass
            try:
                out = model[3].output.save()
            finally:
                log.append("finally")
        assert log == ["finally"]
        torch.testing.assert_close(out, expected(seq, x, 3))


class TestSkippingTheBody:
    """The body of a with-statement in user code is skipped from ``__enter__`` to its first
    line (a line tracer before Python 3.12, a sys.monitoring LINE event on the caller's code
    object from 3.12 on): only the frame that entered skips, and nothing stays armed."""

    def test_another_frame_of_the_same_function_runs_its_own_lines(self, model, seq):
        """Between ``__enter__`` and the body (here: the ``as`` target's index) the same
        function runs in a second frame, with a trace of its own and lines past the body's
        first line; each frame skips its own body once and runs the rest as written."""
        x = torch.randn(2, 6)
        log = []
        saved = {}

        def f(depth):
            holder = {}
            with model.trace(x) as holder[f(depth - 1) if depth else 0]:
                log.append(("body", depth))
                saved[depth] = model[depth].output.save()
            log.append(("after", depth))
            return depth + 1

        assert f(1) == 2
        assert log == [("body", 0), ("after", 0), ("body", 1), ("after", 1)]
        torch.testing.assert_close(saved[0], expected(seq, x, 0))
        torch.testing.assert_close(saved[1], expected(seq, x, 1))

    def test_a_line_tracer_set_meanwhile_does_not_see_the_body_run_in_place(self, model, seq):
        """A debugger's line tracer (``sys.settrace``, as pdb's) sees the with line and the
        lines after the block in the function's own code, never the body's lines there (the
        body runs later, compiled from its source), and is the tracer set after the block."""
        x = torch.randn(2, 6)
        lines = []

        def f():
            with model.trace(x):
                out = model[2].output.save()
            return out

        code = f.__code__
        with_line = code.co_firstlineno + 1

        def tracer(frame, event, arg):
            if frame.f_code is code and event == "line":
                lines.append(frame.f_lineno - with_line)
            return tracer

        previous = sys.gettrace()
        sys.settrace(tracer)
        try:
            out = f()
        finally:
            sys.settrace(previous)
        assert 1 not in lines and lines[0] == 0 and 2 in lines, lines
        torch.testing.assert_close(out, expected(seq, x, 2))

    @pytest.mark.skipif(sys.version_info < (3, 12),
                        reason="before Python 3.12 the skip is a line tracer (sys.settrace)")
    def test_no_global_trace_function_on_312(self, model, seq):
        """On 3.12+ turning ``sys.settrace`` on and off re-instruments every code object on
        the stack and each one run after it (~16 µs a trace); the skip sets no tracer."""
        x = torch.randn(2, 6)
        seen = []

        def probe():
            seen.append(sys.gettrace())
            return 0

        holder = {}
        with model.trace(x) as holder[probe()]:
            out = model[1].output.save()
        assert seen == [None]
        torch.testing.assert_close(out, expected(seq, x, 1))

    @pytest.mark.skipif(sys.version_info < (3, 12),
                        reason="before Python 3.12 the skip is a line tracer (sys.settrace)")
    def test_threads_starting_the_first_traces_at_once(self, seq):
        """The process's first skip claims a sys.monitoring tool id. Threads making their first
        traces at the same moment (each on its own copy of the model) each saw the id free and
        claimed it, and all but one raised ValueError('tool 4 is already in use') from the
        with line. Each thread's saved value is the plain forward's. (The state of a process
        that has made no trace yet is set up again each round: the id given back.)"""
        import copy
        import threading

        from nnsight_lite.capture import skip

        x = torch.randn(2, 6)
        models = [NNsight(copy.deepcopy(seq)) for _ in range(6)]
        errors, outs = [], []

        def run(model, barrier):
            barrier.wait()
            try:
                with model.trace(x):
                    out = model[1].output.save()
                outs.append((out, expected(model._module, x, 1)))
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # (threads switch often: the race shows within rounds)
        try:
            for _ in range(60):
                if skip._tool:
                    sys.monitoring.free_tool_id(skip._tool)
                skip._tool = None
                barrier = threading.Barrier(len(models))
                threads = [threading.Thread(target=run, args=(m, barrier)) for m in models]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                assert errors == []
        finally:
            sys.setswitchinterval(interval)
        assert len(outs) == 60 * len(models)
        for out, want in outs:
            torch.testing.assert_close(out, want)

    def test_an_interrupt_as_the_skip_is_armed_leaves_nothing_armed(self, model, seq):
        """A KeyboardInterrupt (a signal handler's; a remote time limit's stop arrives the same
        way) delivered as the call that arms the body's skip returns propagates from
        ``__enter__``, with no ``__exit__`` to undo the skip. The frame stayed armed: the user's
        ``except KeyboardInterrupt:`` around the block got SkipBody raised from its first line,
        and the frame was kept for good (3.12+; before, the thread's line tracer stayed set).
        Here a profile function raises the interrupt at that call's return, where a real
        SIGINT lands about once in a few hundred interrupts of traces in a loop."""
        from nnsight_lite.capture import skip

        x = torch.randn(2, 6)
        monitored = skip._tool is not False and sys.gettrace() is None
        arm = sys.monitoring.set_local_events if monitored else sys.settrace

        def interrupt(frame, event, arg):
            if event == "c_return" and arg is arm and frame.f_code.co_name == "skip_body":
                sys.setprofile(None)
                raise KeyboardInterrupt

        def run():
            try:
                with model.trace(x):
                    out = model[1].output.save()
                return out
            except KeyboardInterrupt:
                return "interrupted"

        tracer = sys.gettrace()
        sys.setprofile(interrupt)
        try:
            got = run()
        finally:
            sys.setprofile(None)
        assert got == "interrupted"
        assert sys.gettrace() is tracer and not skip._pending
        torch.testing.assert_close(run(), expected(seq, x, 1))


def test_fix_locations_is_the_standard_one_without_its_garbage():
    """capture.parsing.fix_locations gives every node the location ast.fix_missing_locations
    gives it (this package's own sources, a third of the nodes' locations removed at random),
    and leaves no reference cycle (the standard one leaves one per call)."""
    import ast
    import copy
    import pathlib
    import random

    from nnsight_lite.capture.parsing import fix_locations
    from tests.helpers import cycles_left_by

    def spans(tree):
        return [(type(n).__name__, *(getattr(n, a, None) for a in (
            "lineno", "col_offset", "end_lineno", "end_col_offset"))) for n in ast.walk(tree)]

    rng = random.Random(0)
    root = pathlib.Path(nnsight_lite.__file__).parent
    for path in sorted(root.rglob("*.py"))[:30]:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            for name in ("lineno", "col_offset", "end_lineno", "end_col_offset"):
                if rng.random() < 0.3 and hasattr(node, name):
                    delattr(node, name)
        want, got = copy.deepcopy(tree), copy.deepcopy(tree)
        ast.fix_missing_locations(want)
        assert fix_locations(got) is got and spans(got) == spans(want), path
    tree = ast.parse("x = 1")
    assert cycles_left_by(lambda: fix_locations(tree)) == []
