"""Where a body's source comes from, and that it is always the code that is running.

`python -c` programs, IPython cell magics, and the cases where the source found is not the
running code (a module edited after import, exec strings sharing a filename and line, a stale
cell): those must give SourceUnavailableError, never run another block's body.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import linecache
import subprocess
import sys
import textwrap

import pytest
import torch

from nnsight_lite import NNsight, SourceUnavailableError


def run_python(*args, stdin=None):
    return subprocess.run([sys.executable, *args], input=stdin, capture_output=True, text=True,
                          timeout=120)


DASH_C_PROGRAM = textwrap.dedent("""
    import torch
    from nnsight_lite import NNsight
    torch.manual_seed(0)
    seq = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    model = NNsight(seq)
    x = torch.randn(2, 3)
    y = torch.randn(1, 3)
    seen = {}
    handle = seq[0].register_forward_hook(lambda m, i, o: seen.setdefault("h", o.detach()))
    seq(x)
    handle.remove()
    with model.trace(x):
        h = model[0].output.save()
        model[1].output[:] = 0
        out = model.output.save()
    torch.testing.assert_close(h, seen["h"])
    torch.testing.assert_close(out, seq[2](torch.zeros(2, 4)))
    with model.trace() as tracer:
        with tracer.invoke(x):
            a = model[0].output.save()
        with tracer.invoke(y):
            b = model[0].output.save()
    torch.testing.assert_close(a, seq[0](x))
    torch.testing.assert_close(b, seq[0](y))
    def grads():
        xx = x.clone().requires_grad_(True)
        with model.trace(xx):
            hs = model[0].output
            loss = model.output.sum()
            with loss.backward():
                g = hs.grad.save()
        return g
    ref = seq[0](x).detach().requires_grad_(True)
    seq[2](seq[1](ref)).sum().backward()
    torch.testing.assert_close(grads(), ref.grad)
    print("DASH-C OK")
""")


class TestDashC:
    def test_trace_invokes_and_backward_run_in_a_dash_c_program(self):
        """`python -c PROGRAM`: traces, invokes and `with loss.backward():` read their bodies
        from the program (sys.orig_argv) and give the values plain PyTorch gives."""
        proc = run_python("-W", "ignore", "-c", DASH_C_PROGRAM)
        assert proc.returncode == 0, proc.stderr
        assert "DASH-C OK" in proc.stdout

    def test_exec_string_in_a_dash_c_program_is_not_taken_for_the_program(self):
        """An exec'd string is also named '<string>': the -c program is tried, found to be other
        code, and the error says there is no source (its trace has invokes, which cannot run
        in place); the program's block never runs."""
        program = textwrap.dedent("""
            import torch
            from nnsight_lite import NNsight
            model = NNsight(torch.nn.Linear(2, 2))
            x = torch.randn(1, 2)
            ran = []
            src = ("import torch\\n\\n\\n\\n\\nwith model.trace() as tr:\\n"
                   "    with tr.invoke(x):\\n        h = model.output.save()\\n")
            exec(compile(src, "<string>", "exec"))
            if False:
                with model.trace(x):
                    ran.append(1)
        """)
        proc = run_python("-c", program)
        assert proc.returncode != 0
        assert "NoSourceError" in proc.stderr  # a SourceUnavailableError
        assert "no source for '<string>'" in proc.stderr and "`python -c` program was tried" in proc.stderr

    def test_exec_string_single_input_trace_in_a_dash_c_program_runs_in_place(self):
        """A plain exec'd string in a -c program has no source: a single-input trace in it runs
        in place and saves what the plain forward gives. (Python 3.13 registers the -c program
        in linecache under '<string>'; it was taken for found source that is other code, and
        the trace was refused with a SourceUnavailableError.)"""
        program = textwrap.dedent("""
            import torch
            from nnsight_lite import NNsight
            lin = torch.nn.Linear(2, 2)
            model = NNsight(lin)
            x = torch.randn(1, 2)
            exec("with model.trace(x):\\n    h = model.output.save()\\n")
            assert torch.equal(h, lin(x))
            print("IN PLACE OK")
        """)
        proc = run_python("-c", program)
        assert proc.returncode == 0, proc.stderr
        assert "IN PLACE OK" in proc.stdout


def _write_module(path, body_line: str, pad: int = 0):
    path.write_text("import torch\n" + "\n" * pad + textwrap.dedent(f"""
        def first(model, x):
            with model.trace(x):
                h = model[0].output.save()
            return h

        def second(model, x):
            with model.trace(x):
                {body_line}
            return h
    """))


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    yield tmp_path
    for name in ("edited_mod", "reloaded_mod"):
        sys.modules.pop(name, None)
        linecache.cache.pop(str(tmp_path / f"{name}.py"), None)


class TestModuleEditedAfterImport:
    @pytest.mark.parametrize("pad", [0, 3], ids=["same-lines", "lines-shifted"])
    def test_edited_body_is_refused_not_run(self, module_dir, seq, pad):
        """A module whose file is edited after import, with no copy of the imported text left
        in linecache: a call site first reached after the edit raises SourceUnavailableError
        saying to reload; the edited body never runs. Call sites compiled before the edit keep
        running the code that was imported."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        path = module_dir / "edited_mod.py"
        _write_module(path, "h = model[1].output.save()")
        mod = importlib.import_module("edited_mod")
        torch.testing.assert_close(mod.first(model, x), seq[0](x))
        _write_module(path, "h = model[2].output.save(); raise RuntimeError('edited body ran')",
                      pad=pad)
        linecache.checkcache(str(path))  # what any traceback printed after the edit does
        with pytest.raises(SourceUnavailableError,
                           match="edited after the module was imported.*reload"):
            mod.second(model, x)
        torch.testing.assert_close(mod.first(model, x), seq[0](x))

    def test_edited_file_with_the_imported_text_in_linecache_runs_the_imported_body(
            self, module_dir, seq):
        """When linecache still holds the text the module was imported from, that text is the
        running code: the imported body runs, never the edited one."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        path = module_dir / "edited_mod.py"
        _write_module(path, "h = model[1].output.save()")
        mod = importlib.import_module("edited_mod")
        torch.testing.assert_close(mod.first(model, x), seq[0](x))  # caches the imported text
        _write_module(path, "h = model[2].output.save(); raise RuntimeError('edited body ran')")
        torch.testing.assert_close(mod.second(model, x), seq[1](seq[0](x)))

    def test_after_reload_the_edited_body_runs(self, module_dir, seq):
        """Reloading the module makes file and code agree again, even though linecache still
        held the old copy of the file: the edited body runs."""
        model = NNsight(seq)
        x = torch.randn(2, 6)
        path = module_dir / "edited_mod.py"
        _write_module(path, "h = model[1].output.save()")
        mod = importlib.import_module("edited_mod")
        torch.testing.assert_close(mod.second(model, x), seq[1](seq[0](x)))
        assert linecache.getlines(str(path))  # the old copy is cached now
        _write_module(path, "h = model[2].output.save()  # edited")
        mod = importlib.reload(mod)
        torch.testing.assert_close(mod.second(model, x), seq[2](seq[1](seq[0](x))))


RELOADED = textwrap.dedent("""
    import functools


    def passthrough(f):
        @functools.wraps(f)
        def call(*args, **kwargs):
            return f(*args, **kwargs)
        return call


    def probe(model, x):
        with model.trace(x):
            h = model[1].output.save()
        return h


    @passthrough
    def decorated(model, x):
        with model.trace(x):
            h = model[1].output.save()
        return h


    def nested(model, x):
        def inner():
            with model.trace(x):
                h = model[1].output.save()
            return h
        return inner()


    class Prober:
        def __init__(self, model):
            self.model = model

        def read(self, x):
            with self.model.trace(x):
                h = self.model[1].output.save()
            return h
""")


class TestIPythonAutoreload:
    @staticmethod
    def _imported(module_dir, seq):
        """The model, an input, and RELOADED written, imported and recorded by IPython's own
        reloader (what the autoreload extension records before each cell)."""
        dedup = pytest.importorskip("IPython.extensions.deduperreload.deduperreload")
        path = module_dir / "reloaded_mod.py"
        path.write_text(RELOADED)
        mod = importlib.import_module("reloaded_mod")
        reloader = dedup.DeduperReloader()
        reloader.update_sources()
        return NNsight(seq), torch.randn(2, 6), path, mod, reloader

    def test_functions_autoreload_recompiled_run_their_edited_bodies(self, module_dir, seq):
        """IPython 9's `%autoreload 2` patches an edited function with code compiled from its
        definition alone (line numbers counted from the `def`, not the file): a function, a
        decorated one, a closure in one and a method of an existing object all run their edited
        body (reloaded by IPython's own reloader, as the autoreload extension calls it)."""
        model, x, path, mod, reloader = self._imported(module_dir, seq)
        prober = mod.Prober(model)

        def read_all():
            return [mod.probe(model, x), mod.decorated(model, x), mod.nested(model, x),
                    prober.read(x)]

        seen = {}
        handle = seq[1].register_forward_hook(lambda m, i, o: seen.update(h=o.detach().clone()))
        try:
            first = seq(x)  # (ground truth: seq[1]'s output, read by a plain hook)
            for got in read_all():
                torch.testing.assert_close(got, seen["h"])
            path.write_text(RELOADED.replace("output.save()", "output.mul(3).save()"))
            assert reloader.maybe_reload_module(mod)  # patched in place, not re-imported
            assert mod.probe.__code__.co_firstlineno == 1  # counted from the def alone
            for got in read_all():
                torch.testing.assert_close(got, seen["h"] * 3)
            torch.testing.assert_close(seq(x), first)  # (the edits only read)
        finally:
            handle.remove()

    def test_a_file_edited_again_since_the_reload_is_refused(self, module_dir, seq):
        """The definition rebuilt from the file must be the running code: after another edit
        with no reload, the block raises SourceUnavailableError instead of running it."""
        model, x, path, mod, reloader = self._imported(module_dir, seq)
        path.write_text(RELOADED.replace("output.save()", "output.mul(3).save()"))
        assert reloader.maybe_reload_module(mod)
        path.write_text(RELOADED.replace("output.save()", "output.mul(5).save(); 1 / 0"))
        with pytest.raises(SourceUnavailableError, match="reload the module"):
            mod.probe(model, x)


def test_assert_inside_a_body_in_a_pytest_module(seq):
    """pytest rewrites the asserts of test modules (this one): a body containing an `assert`
    is still recognised as the running code, and its assert still checks."""
    model = NNsight(seq)
    x = torch.randn(2, 6)
    with model.trace(x):
        h = model[0].output.save()
        assert h.shape == (2, 6), "the body's assert runs"
    torch.testing.assert_close(h, seq[0](x))
    with pytest.raises(AssertionError, match="the body's assert runs"):
        with model.trace(x):
            h = model[0].output.save()
            assert h.shape == (3, 6), "the body's assert runs"


class TestExecSharingFilename:
    def test_other_source_at_the_same_name_and_line_is_refused(self, seq):
        """exec of a string compiled under a filename whose linecache entry is other code with
        a `with` at the same line: a clear error, and the registered block's body never runs."""
        model = NNsight(seq)
        registered = "with model.trace(x):\n    ran.append('registered body')\n"
        running = "with model.trace(x):\n    h = model[1].output.save()\n"
        filename = "<shared-snippet>"
        linecache.cache[filename] = (len(registered), None, registered.splitlines(True), filename)
        ns = {"model": model, "x": torch.randn(2, 6), "ran": []}
        try:
            with pytest.raises(SourceUnavailableError,
                               match="not the code that is running.*same name '<shared-snippet>'"):
                exec(compile(running, filename, "exec"), ns)
        finally:
            linecache.cache.pop(filename, None)
        assert ns["ran"] == [] and "h" not in ns

    def test_a_missing_file_read_through_the_globals_loader(self, seq, tmp_path):
        """Code compiled under the name of a file that does not exist, run with a module's
        globals: linecache gives that module's source (from its __loader__) for the name. The
        error says so and what to do; it said other source was registered under the name."""
        model = NNsight(seq)
        filename = str(tmp_path / "missing" / "gen.py")
        src = "\n\nwith model.trace(x):\n    h = model[1].output.save()\n"
        ns = {"__name__": __name__, "__file__": __file__,
              "__loader__": importlib.machinery.SourceFileLoader(__name__, __file__),
              "model": model, "x": torch.randn(2, 6)}
        try:
            with pytest.raises(SourceUnavailableError) as info:
                exec(compile(src, filename, "exec"), ns)
        finally:
            linecache.cache.pop(filename, None)
        text = str(info.value)
        assert f"No file {filename!r} exists: linecache took for it the source of module " \
               f"{__name__!r} (through the __loader__" in text
        assert "registered under the same name" not in text and "h" not in ns

    def test_identical_source_under_a_shared_name_runs(self, seq):
        """The same text registered under the name is the running code: it runs."""
        model = NNsight(seq)
        src = "\n\nwith model.trace(x):\n    h = model[1].output.save()\n"
        filename = "<shared-identical>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        x = torch.randn(2, 6)
        ns = {"model": model, "x": x}
        try:
            exec(compile(src, filename, "exec"), ns)
        finally:
            linecache.cache.pop(filename, None)
        torch.testing.assert_close(ns["h"], seq[1](seq[0](x)))


@pytest.fixture
def shell(seq):
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    sh = InteractiveShell.instance()
    sh.user_ns.update(model=NNsight(seq), x=torch.randn(2, 6), y=torch.randn(1, 6), runs=[])
    try:
        yield sh
    finally:
        InteractiveShell.clear_instance()


def run_cell(shell, cell):
    result = shell.run_cell(textwrap.dedent(cell))
    if result.error_in_exec is not None:
        raise result.error_in_exec
    result.raise_error()


class TestIPythonCells:
    @pytest.mark.parametrize("magic", ["%%time", "%%capture captured"])
    def test_cell_magics_run_traces_and_invokes(self, shell, seq, magic):
        """A cell under %%time or %%capture runs its trace and invokes; saved names land in the
        user namespace with the values plain PyTorch gives, unsaved ones do not."""
        run_cell(shell, f"""\
            {magic}
            with model.trace(x):
                h = model[1].output.save()
                tmp = model[2].output
            with model.trace() as tracer:
                with tracer.invoke(x):
                    a = model[0].output.save()
                with tracer.invoke(y):
                    b = model[0].output.save()
            """)
        ns = shell.user_ns
        x, y = ns["x"], ns["y"]
        torch.testing.assert_close(ns["h"], seq[1](seq[0](x)))
        torch.testing.assert_close(ns["a"], seq[0](x))
        torch.testing.assert_close(ns["b"], seq[0](y))
        assert "tmp" not in ns

    def test_timeit_runs_traces_and_invokes(self, shell, seq):
        """%%timeit -n1 -r1 runs the cell's trace and invokes once each. (As in plain IPython,
        names a %%timeit cell binds stay inside the timing function; values reach the user
        namespace through objects the cell mutates.)"""
        run_cell(shell, """\
            %%timeit -n1 -r1
            with model.trace(x):
                runs.append(model[1].output.save())
            with model.trace() as tracer:
                with tracer.invoke(x):
                    runs.append(model[0].output.save())
                with tracer.invoke(y):
                    runs.append(model[2].output.save())
            """)
        runs = shell.user_ns["runs"]
        x, y = shell.user_ns["x"], shell.user_ns["y"]
        assert len(runs) == 3
        torch.testing.assert_close(runs[0], seq[1](seq[0](x)))
        torch.testing.assert_close(runs[1], seq[0](x))
        torch.testing.assert_close(runs[2], seq[2](seq[1](seq[0](y))))

    def test_backward_in_a_time_cell(self, shell, seq):
        """`with loss.backward():` inside a %%time cell reads gradients like plain autograd."""
        run_cell(shell, """\
            %%time
            with model.trace(x):
                hs = model[0].output
                loss = model.output.sum()
                with loss.backward():
                    g = hs.grad.save()
            """)
        ref = seq[0](shell.user_ns["x"]).detach().requires_grad_(True)
        seq[3](seq[2](seq[1](ref))).sum().backward()
        torch.testing.assert_close(shell.user_ns["g"], ref.grad)

    def test_stale_cell_is_refused(self, shell):
        """A function defined in a cell whose recorded text no longer matches the code (a stale
        cell): calling it raises SourceUnavailableError saying to re-run the cell, and the
        other text's body never runs."""
        run_cell(shell, """\
            def probe():
                with model.trace(x):
                    h = model[1].output.save()
                return h
            """)
        filename = shell.user_ns["probe"].__code__.co_filename
        size, mtime, lines, name = linecache.cache[filename]
        stale = [ln.replace("h = model[1].output.save()", "runs.append('stale body')")
                 for ln in lines]
        linecache.cache[filename] = (size, mtime, stale, name)
        with pytest.raises(SourceUnavailableError, match="not the code that is running"):
            run_cell(shell, "probe()\n")
        assert shell.user_ns["runs"] == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_cell_magics_in_a_real_kernel(tmp_path):
    """Through a real Jupyter kernel: %%time, %%capture and %%timeit cells run traces and
    invokes, and the saved names of %%time/%%capture cells exist in later cells."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "import torch\nfrom nnsight_lite import NNsight\ntorch.manual_seed(0)\n"
        "seq = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
        "model = NNsight(seq)\nx = torch.randn(2, 4)\ny = torch.randn(1, 4)\nruns = []",
        "%%time\nwith model.trace(x):\n    h = model[1].output.save()\n"
        "with model.trace() as tracer:\n    with tracer.invoke(x):\n        a = model[0].output.save()\n"
        "    with tracer.invoke(y):\n        b = model[2].output.save()",
        "%%capture cap\nwith model.trace(y):\n    c = model[0].output.save()",
        "%%timeit -n1 -r1\nwith model.trace() as tracer:\n    with tracer.invoke(x):\n"
        "        runs.append(model[0].output.save())",
        "torch.testing.assert_close(h, seq[1](seq[0](x)))\n"
        "torch.testing.assert_close(a, seq[0](x))\ntorch.testing.assert_close(b, seq(y))\n"
        "torch.testing.assert_close(c, seq[0](y))\n"
        "assert len(runs) == 1\ntorch.testing.assert_close(runs[0], seq[0](x))\n"
        "print('magics ran in the kernel')",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    import os
    env_path = os.pathsep.join([str(__import__("pathlib").Path(__file__).resolve().parents[2]),
                                os.environ.get("PYTHONPATH", "")])
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env_path  # the kernel imports this checkout's nnsight_lite
    try:
        client.execute()
    finally:
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old
    out = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "magics ran in the kernel" in out


_TWICE = """
def run(model, x, remote):
    with model.trace(x, remote=remote):
        out = model.output.save()
    return out
"""


def _define_run(filename):
    """``run`` of ``_TWICE`` compiled under ``filename`` (registered in linecache): the same
    function defined again in another cell or file, whose code objects compare equal (==)
    to the other's, since code objects compare without their file."""
    linecache.cache[filename] = (len(_TWICE), None, _TWICE.splitlines(True), filename)
    scope = {"__name__": "__cell__"}
    exec(compile(_TWICE, filename, "exec"), scope)
    return scope["run"]


class TestBodiesCompiledAgain:
    def test_a_body_keeps_its_source_when_an_equal_body_is_freed(self, seq):
        """Two definitions of one function from identical text in two files compile equal
        bodies. A body remembers the source it was compiled from (what a remote trace ships);
        that record was kept per code object by ==, so the second body's source was stored
        under the first body's entry and went with it: once the first function was dropped, a
        remote trace of the second raised RemoteError 'the source of the block at
        <nnsight-lite-test-run-b>:3 is not known'."""
        import gc
        import weakref

        model = NNsight(seq)
        x = torch.randn(2, 6)
        names = ("<nnsight-lite-test-run-a>", "<nnsight-lite-test-run-b>")
        try:
            first, second = (_define_run(name) for name in names)
            torch.testing.assert_close(first(model, x, False), seq(x))
            torch.testing.assert_close(second(model, x, False), seq(x))
            gone = weakref.ref(first.__code__)
            del first
            gc.collect()
            assert gone() is None
            torch.testing.assert_close(second(model, x, "local"), seq(x))
        finally:
            for name in names:
                linecache.cache.pop(name, None)
