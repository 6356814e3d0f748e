"""Which variables reach a run's processes: `relax submit -- python -m relax.ray.envcheck NAME...`

Run as a job driver (or on a node of the cluster), it reads the named variables in the driver, in a plain
Ray actor, and in training-rank actors that relax places in a placement group the way a run does, and
prints one JSON report. Exit status 1 when a named variable is missing from any of those processes.
"""

import argparse
import json
import os
import sys

import ray

from relax.ray.placement import create_placement, create_training_actors

REPORT_PREFIX = "relax-envcheck report: "  # the line of output that carries the JSON report


class EnvReporter:
    """An actor that tells where it runs and what it sees of the named variables."""

    def report(self, names: list[str]) -> dict:
        return process_report(names)


def process_report(names: list[str]) -> dict:
    context = ray.get_runtime_context()
    return {
        "pid": os.getpid(),
        "node_id": context.get_node_id(),
        "accelerator_ids": {name: ids for name, ids in context.get_accelerator_ids().items() if ids},
        "env": {name: os.environ.get(name) for name in names},
    }


def collect(names: list[str], num_devices: int, platform) -> dict:
    """Reports of the driver, a plain actor and `num_devices` placed training ranks."""
    plain = ray.remote(EnvReporter).options(num_cpus=0).remote()
    placement = create_placement(platform, num_devices)
    ranks = create_training_actors(EnvReporter, placement)
    try:
        return {
            "driver": process_report(names),
            "plain_actor": ray.get(plain.report.remote(names)),
            "placed_ranks": ray.get(ranks.call("report", names)),
        }
    finally:
        ranks.kill()
        ray.kill(plain)
        placement.remove()


def missing(report: dict) -> list[str]:
    """`process: NAME` for every named variable a process did not see."""
    processes = [("driver", report["driver"]), ("plain_actor", report["plain_actor"])]
    processes += [(f"rank {rank}", entry) for rank, entry in enumerate(report["placed_ranks"])]
    return [f"{where}: {name}" for where, entry in processes for name, value in entry["env"].items() if value is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relax.ray.envcheck", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="+", metavar="NAME", help="variables to look for")
    parser.add_argument("--devices", type=int, default=1, help="training ranks to place (default 1)")
    parser.add_argument("--device", default="auto", help="platform: auto, cpu, cuda, npu (default auto)")
    parser.add_argument("--output", help="also write the JSON report to this file")
    args = parser.parse_args(argv)

    from relax.platform import get_platform

    platform = get_platform(args.device)
    ray.init(address="auto")  # inside a job: the job's cluster; on a node: its running cluster (never a new one)
    try:
        report = collect(args.names, args.devices, platform)
    finally:
        ray.shutdown()
    text = json.dumps(report, sort_keys=True)
    print(REPORT_PREFIX + text, flush=True)
    if args.output:
        with open(args.output, "w") as out:
            out.write(text)
    absent = missing(report)
    if absent:
        print("relax-envcheck missing: " + ", ".join(absent), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
