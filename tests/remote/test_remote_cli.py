"""The command line serves, lists and stops models on a running cluster; a client with the
wrong Ray token is refused by Ray's own authentication."""

from __future__ import annotations

import os
import subprocess
import sys

import ray
import torch

from nnsight_lite import remote

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args, env=None, timeout=120):
    """``python -m nnsight_lite.remote --address <this cluster> ARGS`` in a subprocess."""
    address = ray.get_runtime_context().gcs_address
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "nnsight_lite.remote", "--address", address,
                           *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def test_serve_list_stop_from_the_command_line(served, mlp_model):
    """`serve` starts a replica that a client then uses (same result as a local trace), `list`
    names it, `stop` ends it and `list` no longer does."""
    done = cli("serve", "nnsight_lite.remote.testing:mlp", "--name", "mlp-cli",
               "--num-cpus", "0.25")
    assert done.returncode == 0, done.stderr[-2000:]
    try:
        assert "mlp-cli" in cli("list").stdout
        x = torch.randn(3, 8)
        with mlp_model.trace(x, backend=remote.Backend("mlp-cli")):
            out = mlp_model.output.save()
        torch.testing.assert_close(out, mlp_model._module(x))
    finally:
        stopped = cli("stop", "mlp-cli")
    assert stopped.returncode == 0 and "stopped 1 replica" in stopped.stdout
    assert "mlp-cli" not in cli("list").stdout


def test_a_client_with_the_wrong_token_is_refused(served, cluster):
    """With token authentication on (Ray's default here), a driver holding another token cannot
    join the cluster: the command fails instead of listing what is served."""
    assert cluster["token_auth"]
    done = cli("list", env={"RAY_AUTH_TOKEN": "0" * 32}, timeout=90)
    assert done.returncode == 2
    assert "could not join the Ray cluster" in done.stderr
    assert "mlp" not in done.stdout
    assert "auth" in (done.stderr + done.stdout).lower(), done.stderr[-3000:]
