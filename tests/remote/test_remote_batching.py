"""Concurrent clients: compatible requests arriving together at one replica run as invokes of
one batched forward, each seeing its own rows and names; one that raises fails alone."""

from __future__ import annotations

import threading
import traceback

import pytest
import ray
import torch

from nnsight_lite import remote


@pytest.fixture(scope="module")
def batching(cluster):
    """One replica of the MLP gathering requests for 0.5 s."""
    handles = remote.serve("nnsight_lite.remote.testing:mlp", name="mlp-batch",
                           batch_window=0.5, num_cpus=0.25)
    try:
        yield handles[0]
    finally:
        remote.stop("mlp-batch")


def _together(*jobs):
    """Run each job on its own thread, released at once; their results (or exceptions)."""
    barrier = threading.Barrier(len(jobs))
    out = [None] * len(jobs)

    def run(i, job):
        barrier.wait()
        try:
            out[i] = job()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_two_clients_share_one_forward(batching, mlp_model):
    """Two clients' traces sent together run in one forward (one run on the replica); each
    gets only its own rows and its own saved names, equal to running it alone locally."""
    model = mlp_model
    a, b = torch.randn(2, 8), torch.randn(3, 8)
    scale = torch.tensor(2.0)

    def client_a():
        backend = remote.Backend("mlp-batch")
        with model.trace(a, backend=backend):
            model[0].output[:] = model[0].output * scale
            out_a = model.output.save()
        return out_a, backend.last_batch

    def client_b():
        backend = remote.Backend("mlp-batch")
        with model.trace(b, backend=backend):
            h_b = model[2].output.save()
        return h_b, backend.last_batch

    client_a(), client_b()  # (each client's first trace: body captured, compiled, shipped, the
    # replica's code cached; cold, one could reach the replica after the other's window closed)
    runs = ray.get(batching.info.remote())["runs"]
    results = _together(client_a, client_b)
    assert not any(isinstance(r, Exception) for r in results), results
    (out_a, batch_a), (h_b, batch_b) = results
    assert ray.get(batching.info.remote())["runs"] == runs + 1
    assert batch_a == batch_b == 2
    with model.trace(a):
        model[0].output[:] = model[0].output * scale
        ref_a = model.output.save()
    with model.trace(b):
        ref_b = model[2].output.save()
    assert torch.allclose(out_a, ref_a) and out_a.shape == (2, 4)
    assert torch.allclose(h_b, ref_b) and h_b.shape == (3, 16)


def test_each_client_gets_its_own_warnings(batching, mlp_model):
    """Warnings raised by two clients' bodies run in one batched forward come back to the
    client whose body raised them, each once, at its own line."""
    import warnings

    model = mlp_model
    a, b = torch.randn(2, 8), torch.randn(3, 8)

    def client(x, tag):
        def run():
            backend = remote.Backend("mlp-batch")
            with model.trace(x, backend=backend):
                warnings.warn(f"{tag}: {model[0].output.shape[0]} rows")
            return backend.last_batch
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        client(a, "a")(), client(b, "b")()  # (warm: see test_two_clients_share_one_forward)
    with warnings.catch_warnings(record=True) as caught:  # (both threads' warnings, here)
        warnings.simplefilter("always")
        results = _together(client(a, "a"), client(b, "b"))
    assert results == [2, 2]
    line = client.__code__.co_firstlineno + 4  # the warnings.warn line
    got = sorted((str(w.message), w.filename, w.lineno) for w in caught)
    assert got == [("a: 2 rows", __file__, line), ("b: 3 rows", __file__, line)]


def test_one_failing_request_fails_alone(batching, mlp_model):
    """In a group where one request raises, that request gets its own error (its traceback
    ending at its line); the other still gets its correct result."""
    model = mlp_model
    a, b = torch.randn(2, 8), torch.randn(2, 8)

    def good():
        with model.trace(a, backend=remote.Backend("mlp-batch")):
            out = model.output.save()
        return out

    def bad():
        with model.trace(b, backend=remote.Backend("mlp-batch")):
            model[0].output.save()
            raise LookupError("no such thing")

    out, err = _together(good, bad)
    assert isinstance(err, LookupError) and err.args == ("no such thing",)
    last = traceback.extract_tb(err.__traceback__)[-1]  # the user's line, as locally
    assert last.filename == __file__ and "raise LookupError" in last.line
    assert torch.allclose(out, model._module(a))


@pytest.fixture(scope="module")
def gpt2_batching(served):
    """The tiny GPT-2 served again as "gpt2-batch", gathering requests for 0.5 s."""
    handles = remote.serve(served["gpt2"], name="gpt2-batch", batch_window=0.5, num_cpus=0.25)
    try:
        yield handles[0]
    finally:
        remote.stop("gpt2-batch")


def test_prompts_of_other_lengths_are_not_padded_together(gpt2_batching, gpt2_meta, gpt2_local):
    """Three clients' single-prompt traces arrive together: the two prompts of one token
    length share a forward, the third (shorter) runs alone, and each saved hidden state has
    its own prompt's length and values, as a local run. Batched with the others, the short
    prompt was left-padded: its body saw, saved (and would have edited) 9 positions where a
    local trace has 2. Ground truth: a forward hook on the plain transformers model."""
    prompts = ["the tower", "the arena", "hi"]

    def client(prompt):
        def job():
            backend = remote.Backend("gpt2-batch")
            with gpt2_meta.trace(prompt, backend=backend):
                h = gpt2_meta.transformer.h[1].output.save()
            return h, backend.last_batch
        return job

    results = _together(*(client(p) for p in prompts))
    assert not any(isinstance(r, Exception) for r in results), results
    assert [batch for _, batch in results] == [2, 2, 1]
    hf = gpt2_local._module
    for prompt, (h, _) in zip(prompts, results):
        got = []
        handle = hf.transformer.h[1].register_forward_hook(lambda m, i, o: got.append(o))
        try:
            with torch.no_grad():
                hf(**gpt2_local.tokenizer(prompt, return_tensors="pt"))
        finally:
            handle.remove()
        want = got[0][0] if isinstance(got[0], tuple) else got[0]
        assert h.shape == want.shape == (1, len(prompt), 32)
        torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-5)
