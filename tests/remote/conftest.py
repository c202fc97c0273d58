"""A local Ray cluster on loopback for the remote tests, and the models served on it.

The cluster starts once per test session (token authentication on: Ray 2.60's default for a
local cluster) and is shut down at the end. Replicas: a small MLP (from the factory
``nnsight_lite.remote.testing:mlp``) and a tiny GPT-2 saved to a temporary directory, served by
path as a LanguageModel; clients hold the GPT-2 on the meta device.
"""

from __future__ import annotations

import os
import warnings

import pytest

ray = pytest.importorskip("ray")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = "nnsight_lite.remote.testing:mlp"


@pytest.fixture(scope="session")
def cluster():
    """A 2-CPU local Ray cluster whose workers import this checkout of nnsight_lite."""
    from ray._raylet import AuthenticationMode, get_authentication_mode

    from nnsight_lite.remote.server import NAMESPACE

    env = {"PYTHONPATH": ROOT, "TOKENIZERS_PARALLELISM": "false"}
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             runtime_env={"env_vars": env}, _node_ip_address="127.0.0.1")
    try:
        yield {"token_auth": get_authentication_mode() == AuthenticationMode.TOKEN}
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def served(cluster, tmp_path_factory):
    """Serve the MLP (2 replicas) and the tiny GPT-2 (1 replica); yield {"gpt2": its dir}."""
    from nnsight_lite import remote
    from nnsight_lite.remote.testing import save_tiny_gpt2

    gpt2 = save_tiny_gpt2(tmp_path_factory.mktemp("remote-gpt2"))
    handles = remote.serve(MLP, name="mlp", replicas=2, num_cpus=0.25, wait=False)
    handles += remote.serve(gpt2, replicas=1, num_cpus=0.25, wait=False)
    ray.get([h.ping.remote() for h in handles])
    try:
        yield {"gpt2": gpt2}
    finally:
        remote.stop("mlp")
        remote.stop(os.path.basename(gpt2))


@pytest.fixture
def backend(served):
    """The backend ``remote=True`` uses: the served MLP."""
    from nnsight_lite import remote
    from nnsight_lite.remote import client

    before = client._default
    b = remote.connect(name="mlp")
    yield b
    client._default = before


@pytest.fixture
def mlp_model():
    from nnsight_lite.remote.testing import mlp

    return mlp()


@pytest.fixture
def gpt2_meta(served):
    """The tiny GPT-2 as a client holds it: LanguageModel(path), weights on meta."""
    from nnsight_lite import LanguageModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LanguageModel(served["gpt2"])


@pytest.fixture
def gpt2_local(served):
    """The same GPT-2 with its weights loaded here: the ground truth."""
    from nnsight_lite import LanguageModel

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LanguageModel(served["gpt2"], dispatch=True)
