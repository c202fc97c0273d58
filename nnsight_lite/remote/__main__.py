"""``python -m nnsight_lite.remote``: serve, list and stop models on a Ray cluster.

    python -m nnsight_lite.remote serve smollm2 --replicas 2 --num-cpus 2
    python -m nnsight_lite.remote serve openai-community/gpt2 --num-gpus 1 --dtype float16
    python -m nnsight_lite.remote serve mypkg.models:build --name mine
    python -m nnsight_lite.remote list
    python -m nnsight_lite.remote stop smollm2

``--address`` picks the cluster (default: the one ``ray start --head`` made on this machine).
Replicas are detached: they keep serving after this command exits.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nnsight_lite.remote",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="start replicas of a model")
    s.add_argument("model", help="smollm2, a Hugging Face id or path, or pkg.module:factory")
    s.add_argument("--name", help="what clients ask for (default: derived from the model)")
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--num-cpus", type=float, default=1)
    s.add_argument("--num-gpus", type=float, default=0)
    s.add_argument("--device-map", help='passed to from_pretrained (e.g. "auto")')
    s.add_argument("--dtype", help="float32, float16, bfloat16 ... (passed to loading)")
    s.add_argument("--time-limit", type=float, default=600, help="seconds per request")
    s.add_argument("--max-bytes", type=int, default=1 << 30, help="bytes a request may return")
    s.add_argument("--batch-window", type=float, default=None,
                   help="seconds to gather single-input traces into one forward")
    s.add_argument("--policy", action="store_true",
                   help="refuse bodies that import, touch dunders or call unlisted names")
    sub.add_parser("list", help="list served models")
    t = sub.add_parser("stop", help="stop a served model's replicas")
    t.add_argument("name")
    args = parser.parse_args(argv)

    import ray

    from .server import NAMESPACE, serve, served, stop

    try:
        ray.init(address=args.address, namespace=NAMESPACE, log_to_driver=False)
    except ConnectionError as exc:  # no cluster there, or Ray's authentication refused us
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        print(f"could not join the Ray cluster at {args.address}: {cause}\n(start one with "
              "`ray start --head`, or give this machine the cluster's token: ~/.ray/auth_token "
              "or RAY_AUTH_TOKEN)", file=sys.stderr)
        return 2
    if args.command == "serve":
        serve(args.model, name=args.name, replicas=args.replicas, num_cpus=args.num_cpus,
              num_gpus=args.num_gpus, device_map=args.device_map, dtype=args.dtype,
              time_limit=args.time_limit, max_bytes=args.max_bytes,
              batch_window=args.batch_window, policy=args.policy)
        print(f"serving: {', '.join(served())}")
    elif args.command == "list":
        print("\n".join(served()) or "(nothing served)")
    else:
        n = stop(args.name)
        print(f"stopped {n} replica(s) of {args.name!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
