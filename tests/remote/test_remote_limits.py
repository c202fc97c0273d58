"""Limits: a body past its time limit is stopped and the replica keeps serving; saved values
over the byte cap are refused; a replica killed mid-request gives a clear error and Ray brings
it back."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import ray
import ray.exceptions
import torch

from nnsight_lite import remote
from nnsight_lite.remote.server import replicas_of
from nnsight_lite.errors import RemoteError, RemoteTimeoutError, ResultTooLargeError

MLP_FACTORY = "nnsight_lite.remote.testing:mlp"


def _x():
    return torch.ones(2, 8)


def test_time_limit_stops_body_and_replica_stays_healthy(served, mlp_model):
    """A pure-Python endless loop in a body is stopped at the time limit with
    RemoteTimeoutError; the same replica then runs the next request correctly."""
    model = mlp_model
    backend = remote.Backend("mlp", time_limit=1.0)
    backend._replicas["mlp"] = replicas_of("mlp")[:1]  # both requests go to one replica
    start = time.perf_counter()
    with pytest.raises(RemoteTimeoutError, match="time limit of 1 s"):
        with model.trace(_x(), backend=backend):
            h = model[0].output
            while True:
                h = h + 0
    assert time.perf_counter() - start < 10
    with model.trace(_x(), backend=backend):
        out = model.output.save()
    assert torch.allclose(out, model._module(_x()))


def test_exit_in_a_body_reaches_the_client_and_the_replica_serves_on(served, mlp_model):
    """`raise SystemExit(3)` (exit(), sys.exit(3)) in a remote body reaches the client as
    SystemExit(3), as locally, and the same replica serves the next request. It was no
    Exception: it left the replica's serving thread and stopped the actor's event loop, so
    that request and every later one to the replica waited for ever (here: the client's
    time limit plus its slack, then RemoteTimeoutError). Ground truth: the plain module."""
    model = mlp_model
    backend = remote.Backend("mlp", time_limit=2.0)
    backend._replicas["mlp"] = replicas_of("mlp")[:1]  # both requests go to one replica
    with pytest.raises(SystemExit) as info:
        with model.trace(_x(), backend=backend):
            if model[0].output.shape[0] == 2:
                raise SystemExit(3)
    assert info.value.args == (3,)
    with model.trace(_x(), backend=backend):
        out = model.output.save()
    assert torch.allclose(out, model._module(_x()))


def test_a_header_calling_python_after_the_trace_runs_on_a_replica_that_served_before(
        served, mlp_model):
    """`with model.trace(x, backend=b), contextlib.nullcontext():` on a replica whose earlier
    request ran under a time limit: the replica's Deadline used to cancel a pending stop with
    PyThreadState_SetAsyncExc(thread, NULL), which on CPython 3.11 leaves the interpreter's
    async-exception flag raised; the nullcontext's __enter__, entered while the trace's body
    skipper is set, then spun in the eval loop until the time limit (RemoteTimeoutError after
    5 s here; 600 s under the server's default). Same with `as t, ExitStack()`."""
    model = mlp_model
    x = _x()
    backend = remote.Backend("mlp", time_limit=5.0)
    backend._replicas["mlp"] = replicas_of("mlp")[:1]  # every request goes to one replica
    with model.trace(x, backend=backend):
        first = model.output.save()
    start = time.perf_counter()
    with model.trace(x, backend=backend), contextlib.nullcontext():
        h = model[0].output.save()
    with model.trace(x, backend=backend) as tracer, contextlib.ExitStack():
        out = model.output.save()
    assert time.perf_counter() - start < 4
    assert torch.allclose(first, model._module(x)) and torch.allclose(out, model._module(x))
    assert torch.allclose(h, model._module[0](x)) and tracer is not None


def test_byte_cap(served, mlp_model):
    """Saved values over the request's byte cap give ResultTooLargeError naming the sizes; a
    small result under the cap comes back."""
    model = mlp_model
    backend = remote.Backend("mlp", max_bytes=4096)
    with pytest.raises(ResultTooLargeError, match="big: "):
        with model.trace(_x(), backend=backend):
            big = model[0].output.repeat(100, 1).save()  # 200x16 floats: 12.8 kB
    with model.trace(_x(), backend=backend):
        small = model[0].output.save()
    assert small.shape == (2, 16)
    assert "big" not in locals()


def _wait_alive(handle, timeout=60):
    """Ping ``handle`` until Ray has restarted it (calls fail while it restarts)."""
    end = time.monotonic() + timeout
    while True:
        try:
            return ray.get(handle.ping.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > end:
                raise
            time.sleep(0.2)


def test_killed_replica(cluster, mlp_model):
    """A replica killed during a request: the client gets RemoteError saying so; Ray restarts
    the replica and the next request works."""
    handles = remote.serve("nnsight_lite.remote.testing:mlp", name="mlp-kill", num_cpus=0.25)
    try:
        model = mlp_model
        backend = remote.Backend("mlp-kill")
        errors = []

        def client():
            try:
                with model.trace(_x(), backend=backend):
                    model[0].output.save()
                    time.sleep(30)
            except BaseException as exc:  # noqa: BLE001 - checked below
                errors.append(exc)

        t = threading.Thread(target=client)
        t.start()
        time.sleep(1.5)  # the request is running on the replica
        ray.kill(handles[0], no_restart=False)
        t.join(60)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], RemoteError)
        assert "died" in str(errors[0]) and "mlp-kill" in str(errors[0])
        _wait_alive(handles[0])
        with model.trace(_x(), backend=backend):
            out = model.output.save()
        assert torch.allclose(out, model._module(_x()))
    finally:
        remote.stop("mlp-kill")


def test_stopped_model_says_so_and_a_new_serve_is_found(cluster, mlp_model):
    """A request to a model whose replicas were stopped (after the backend used them) says the
    replica ended and will not restart, not that Ray restarts it; once the model is served
    again, the same backend finds the new replica and gives the local result."""
    remote.serve(MLP_FACTORY, name="mlp-restop", num_cpus=0.25)
    try:
        model, x = mlp_model, _x()
        backend = remote.Backend("mlp-restop")
        with model.trace(x, backend=backend):
            model.output.save()
        remote.stop("mlp-restop")
        with pytest.raises(RemoteError, match="has ended and will not restart") as info:
            with model.trace(x, backend=backend):
                model.output.save()
        assert "restarts it" not in str(info.value) and "'mlp-restop'" in str(info.value)
        remote.serve(MLP_FACTORY, name="mlp-restop", num_cpus=0.25)
        with model.trace(x, backend=backend):
            out = model.output.save()
        torch.testing.assert_close(out, model._module(x))
    finally:
        remote.stop("mlp-restop")


NOT_CONNECTED = """
import ray, torch
from nnsight_lite import remote
from nnsight_lite.errors import RemoteError
from nnsight_lite.remote.testing import mlp
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False,
         namespace="nnsight_lite", _node_ip_address="127.0.0.1",
         runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
remote.serve("nnsight_lite.remote.testing:mlp", name="mlp", num_cpus=0.25)
remote.connect(name="mlp")
model, x = mlp(), torch.ones(2, 8)
with model.trace(x, remote=True):
    out = model.output.save()
assert torch.allclose(out, model._module(x))
ray.shutdown()
for call in ("trace", "served", "stop"):
    try:
        if call == "trace":
            with model.trace(x, remote=True):
                out = model.output.save()
        else:
            getattr(remote, call)(*(("mlp",) if call == "stop" else ()))
    except RemoteError as exc:
        print(call, "RemoteError", str(exc).replace("\\n", " "))
    print(call, "initialized", ray.is_initialized())
"""


def test_after_ray_shutdown_calls_say_so_and_start_no_cluster():
    """After ray.shutdown() a remote trace (its backend holding a replica's handle),
    remote.served() and remote.stop() raise RemoteError saying the process left the cluster;
    none of them starts a new local Ray instance."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", f"ROOT = {root!r}" + NOT_CONNECTED],
                          env={**os.environ, "PYTHONPATH": root}, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    for call in ("trace", "served", "stop"):
        assert f"{call} initialized False" in lines, done.stdout
        said = [ln for ln in lines if ln.startswith(f"{call} RemoteError")]
        assert said and "remote.connect(address)" in said[0], done.stdout
    assert done.stderr.count("Started a local Ray instance") == 1  # the one ray.init started


def test_policy_refuses_before_running_and_passes_ordinary_bodies(served, mlp_model):
    """A deployment served with policy=True refuses a body that imports a module, with
    PolicyError naming the user's file and line, and nothing of the body runs (its print never
    arrives); an ordinary body on the same deployment gives the local result."""
    from nnsight_lite.errors import PolicyError

    remote.serve(MLP_FACTORY, name="mlp-policy", replicas=1, num_cpus=0.25, policy=True)
    try:
        model = mlp_model
        backend = remote.Backend("mlp-policy")
        x = _x()  # a policy body's header may not call the caller's functions: pass data
        with pytest.raises(PolicyError, match=rf"{__file__}:\d+: `import os.*`: a body may not "
                                              "import modules") as info:
            with model.trace(x, backend=backend):
                print("this never prints")
                import os  # noqa: F401
        assert not getattr(info.value, "__notes__", None)  # no replica frames for a refusal
        assert backend.last_received < 4096
        scale = 2.0
        with model.trace(x, backend=backend):
            h = model[0].output.save()
            model[0].output = model[0].output * scale
            out = torch.nn.functional.softmax(model.output, dim=-1).save()
        with model.trace(x):
            h_local = model[0].output.save()
            model[0].output = model[0].output * scale
            out_local = torch.nn.functional.softmax(model.output, dim=-1).save()
        torch.testing.assert_close(h, h_local)
        torch.testing.assert_close(out, out_local)
    finally:
        remote.stop("mlp-policy")
