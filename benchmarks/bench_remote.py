"""Remote traces on a local Ray cluster: round-trip overhead, and 8 clients with batching.

    python benchmarks/bench_remote.py            # PYTHONPATH=. if nnsight_lite is not installed

1. overhead: a small trace (the MLP of nnsight_lite.remote.testing, save one output) run
   remotely vs the same trace run locally; median of N runs (target: under 5 ms extra).
2. throughput: 8 client threads each sending traces for a few seconds to one replica, with
   ``batch_window`` off and on; traces per second.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import ray
import torch

from nnsight_lite import remote
from nnsight_lite.remote.testing import mlp

N = 300
CLIENTS = 8
SECONDS = 4.0


def overhead(model, backend, x):
    def local():
        with model.trace(x):
            out = model.output.save()
        return out

    def far():
        with model.trace(x, backend=backend):
            out = model.output.save()
        return out

    times = {}
    for name, fn in (("local", local), ("remote", far)):
        for _ in range(20):
            fn()
        samples = []
        for _ in range(N):
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        times[name] = statistics.median(samples) * 1e3
    return times


def throughput(model, name):
    stop = time.perf_counter() + SECONDS
    counts = [0] * CLIENTS

    def client(i):
        backend = remote.Backend(name)
        x = torch.randn(4, 8)
        while time.perf_counter() < stop:
            with model.trace(x, backend=backend):
                out = model.output.save()  # noqa: F841
            counts[i] += 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.perf_counter() - start)


def main():
    torch.set_num_threads(1)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, namespace="nnsight_lite",
             runtime_env={"env_vars": {"PYTHONPATH": root, "OMP_NUM_THREADS": "1"}})
    factory = "nnsight_lite.remote.testing:mlp"
    try:
        remote.serve(factory, name="bench-mlp", num_cpus=0.5)
        remote.serve(factory, name="bench-mlp-batched", num_cpus=0.5, batch_window=0.002)
        model = mlp()
        t = overhead(model, remote.Backend("bench-mlp"), torch.randn(4, 8))
        print(f"small trace: local {t['local']:.3f} ms, remote {t['remote']:.3f} ms, "
              f"overhead {t['remote'] - t['local']:.3f} ms (median of {N})")
        for name in ("bench-mlp", "bench-mlp-batched"):
            rate = throughput(model, name)
            print(f"{CLIENTS} clients, {'batching on ' if 'batched' in name else 'batching off'}"
                  f": {rate:.0f} traces/s")
    finally:
        remote.stop("bench-mlp")
        remote.stop("bench-mlp-batched")
        ray.shutdown()


if __name__ == "__main__":
    main()
