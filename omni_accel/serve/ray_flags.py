"""The flags of ``omni-accel serve --ray`` and their checks (no Ray import: ``serve --help`` and a bad flag need no
Ray). The deployments they configure are in serve/ray_app.py; docs/ray.md."""

from __future__ import annotations

import argparse

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``--ray`` flags of ``omni-accel serve`` (server.add_arguments adds them to the serve parser)."""
    r = p.add_argument_group("Ray Serve: replicas behind one endpoint (docs/ray.md; pip install 'omni-accel[ray]')")
    r.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve: this server's routes as the ingress, the models in replicas")
    r.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="the Ray cluster to join ('auto' on a node of a running cluster, ray://HOST:10001); "
                        "default: RAY_ADDRESS, else a new local cluster")
    n = r.add_mutually_exclusive_group()
    n.add_argument("--replicas", type=int, default=None, metavar="N", help="a fixed number of replicas (default 1)")
    n.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                   help="let Ray Serve scale the replicas between MIN and MAX on their ongoing requests (MIN 0: "
                        "scale to zero when idle)")
    r.add_argument("--target-ongoing-requests", type=float, default=None, metavar="N",
                   help="with --autoscale: the queued + running requests per replica to aim at (default: "
                        "--max-concurrency, i.e. one full batch each)")
    r.add_argument("--upscale-delay", type=float, default=None, metavar="S",
                   help="with --autoscale: seconds of high load before adding replicas (Ray Serve's default 30)")
    r.add_argument("--downscale-delay", type=float, default=None, metavar="S",
                   help="with --autoscale: seconds of low load before removing replicas (Ray Serve's default 600)")
    r.add_argument("--gpus-per-replica", type=int, default=1, metavar="G",
                   help="processes per replica, one GPU each: with G > 1 a replica is one parallel group (the "
                        "product of --sp/--cfg-parallel/--tp... must be G), NCCL on GPUs; with --device cpu, G "
                        "CPU processes (gloo) (default 1)")
    r.add_argument("--replica-cpus", type=float, default=1.0, metavar="C",
                   help="CPUs each process of a replica reserves (its torch threads; default 1)")
    r.add_argument("--placement-strategy", choices=STRATEGIES, default="PACK",
                   help="how a replica's G processes are placed on the nodes: PACK (one node when it fits), "
                        "STRICT_PACK (one node or not at all), SPREAD / STRICT_SPREAD (over nodes) (default PACK)")


RAY_ONLY = {"ray_address": None, "replicas": None, "autoscale": None, "target_ongoing_requests": None,
            "upscale_delay": None, "downscale_delay": None, "gpus_per_replica": 1, "replica_cpus": 1.0,
            "placement_strategy": "PACK"}


def check_arguments(args) -> None:
    """Refuse bad Ray flags before anything starts (CliError naming the flag and the fix); without --ray, refuse
    the flags that only mean something with it."""
    from ..cli import CliError
    from ..config import AccelConfig

    if not args.ray:
        given = [name for name, default in RAY_ONLY.items() if getattr(args, name, default) != default]
        if given:
            flags = ", ".join("--" + name.replace("_", "-") for name in given)
            raise CliError(f"{flags}: Ray Serve flag(s); add --ray to serve through Ray Serve (pip install "
                           "'omni-accel[ray]'), or drop them.")
        return
    if args.replicas is not None and args.replicas < 1:
        raise CliError(f"--replicas {args.replicas} is invalid: it must be >= 1 (--autoscale 0:N scales to zero).")
    if args.autoscale is not None:
        autoscale_bounds(args.autoscale)
    elif args.target_ongoing_requests is not None or args.upscale_delay is not None \
            or args.downscale_delay is not None:
        raise CliError("--target-ongoing-requests / --upscale-delay / --downscale-delay apply to --autoscale MIN:MAX; "
                       "add it, or drop them.")
    if args.target_ongoing_requests is not None and args.target_ongoing_requests <= 0:
        raise CliError(f"--target-ongoing-requests {args.target_ongoing_requests} is invalid: it must be > 0.")
    for name in ("upscale_delay", "downscale_delay"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: it must be >= 0.")
    if args.gpus_per_replica < 1:
        raise CliError(f"--gpus-per-replica {args.gpus_per_replica} is invalid: it must be >= 1.")
    if args.replica_cpus < 0:
        raise CliError(f"--replica-cpus {args.replica_cpus} is invalid: it must be >= 0.")
    degrees = AccelConfig(sp=args.sp, ulysses=args.ulysses, ring=args.ring, cfg_parallel=args.cfg_parallel,
                          tp=args.tp)
    try:
        world = degrees.world_size
    except Exception as exc:  # noqa: BLE001 -- inconsistent degrees: the single server's message
        raise CliError(str(exc))
    if world != args.gpus_per_replica:
        raise CliError(f"the parallel degrees make a group of {world} process(es) but --gpus-per-replica is "
                       f"{args.gpus_per_replica}: set --gpus-per-replica {world}, or degrees whose product is "
                       f"{args.gpus_per_replica} (e.g. --sp {args.gpus_per_replica}).")
    if getattr(args, "enable_sleep_mode", False):
        raise CliError("--enable-sleep-mode is not offered with --ray: use --autoscale 0:N instead (idle replicas "
                       "are removed, their GPUs freed, and come back on the next request).")


def autoscale_bounds(value: str) -> tuple[int, int]:
    from ..cli import CliError

    try:
        low, high = (int(part) for part in value.split(":"))
    except ValueError:
        raise CliError(f"--autoscale {value!r} is not MIN:MAX (two whole numbers, e.g. --autoscale 1:4).")
    if not 0 <= low <= high or high < 1:
        raise CliError(f"--autoscale {value!r} is invalid: it needs 0 <= MIN <= MAX and MAX >= 1.")
    return low, high
