"""The driver's own cost of taking back the prompt groups in flight when a rollout aborts them: every group comes back
at once (over-sampling's abort of the surplus, partial rollout's), and the step waits while the driver takes them.

    python benchmarks/rollout_dispatch.py --groups 256 1024 2048 --engines 2

relax.run.colocation.Colocation dispatches the groups (submit, abort, next_done) to a real Ray ActorGroup on a real
placement, watched as in a run. The engines are Ray actors that answer generate_group only once abort_requests is
called, with one empty aborted completion per request: no SGLang, so what is timed is the driver alone. For each
number of groups it prints the seconds Colocation.next_done takes to return them all after the abort, against one
ray.get of the same calls' refs after the same abort (the floor: Ray's own transfer of the answers), and their
ratio.
"""

import argparse
import threading
import time

import ray

from relax.platform import get_platform
from relax.ray.faults import FaultPlan
from relax.ray.placement import ActorGroup, create_placement
from relax.ray.watch import Timeout
from relax.rollout.engine import Completion, SamplingConfig
from relax.run.colocation import Colocation


class AnswersAtAbort:
    """An engine's generate_group that ends only at abort_requests, as SGLang's requests of a long tail do."""

    RAY_OPTIONS = {"max_concurrency": 4096}

    def __init__(self):
        self.aborted = threading.Event()
        self.returned = 0
        self.lock = threading.Lock()

    def generate_group(self, prompt, sampling, prefixes, source, evaluation) -> list[Completion]:
        self.aborted.wait()
        with self.lock:
            self.returned += 1
        return [Completion.aborted() for _ in range(sampling.n)]

    def abort_requests(self) -> None:
        self.aborted.set()

    def answered(self, calls: int) -> None:
        """Returns once `calls` calls have returned since the last time, and stops answering until the next abort."""
        while self.returned < calls:
            time.sleep(0.01)
        self.returned = 0
        self.aborted.clear()


def time_take_back(colocation: Colocation, engines: ActorGroup, groups: int, samples: int) -> tuple[float, float]:
    """Seconds to take back `groups` aborted groups through Colocation.next_done, and through one ray.get of as many
    calls made on the engines directly. Either way the groups go round the engines in turn (Colocation's balance of
    equal groups), and the clock starts once every engine has returned all its calls."""
    sampling = SamplingConfig(n=samples)
    calls = [len(range(index, groups, len(engines))) for index in range(len(engines))]
    for key in range(groups):
        colocation.submit(key, [1, 2, 3], sampling)
    colocation.abort()
    ray.get([actor.answered.remote(count) for actor, count in zip(engines.actors, calls)])
    start = time.perf_counter()
    returned = {colocation.next_done()[0] for _ in range(groups)}
    driver = time.perf_counter() - start
    assert returned == set(range(groups))
    refs = [engines.actors[key % len(engines)].generate_group.remote([1, 2, 3], sampling, None, None, False)
            for key in range(groups)]
    engines.run("abort_requests")
    ray.get([actor.answered.remote(count) for actor, count in zip(engines.actors, calls)])
    start = time.perf_counter()
    ray.get(refs)
    return driver, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--samples", type=int, default=8, help="requests per group (--n-samples-per-prompt)")
    parser.add_argument("--engines", type=int, default=2)
    args = parser.parse_args()
    ray.init(num_cpus=args.engines, include_dashboard=False, logging_level="ERROR")
    placement = create_placement(get_platform("cpu"), args.engines)
    engines = ActorGroup(AnswersAtAbort, placement, list(range(args.engines)), 0.5, [{}] * args.engines,
                         role="engine")
    settings = argparse.Namespace(
        max_engine_restarts=0, engine_start_timeout=Timeout(None, "--engine-start-timeout"),
        rollout_timeout=Timeout(None, "--rollout-timeout"), weight_sync_timeout=Timeout(None, "--weight-sync-timeout"),
    )
    colocation = Colocation(None, engines, 1, settings, FaultPlan())
    time_take_back(colocation, engines, 16, args.samples)  # warm-up: the watch actors start
    print(f"{'groups':>7} {'next_done s':>12} {'ray.get s':>10} {'ratio':>7}")
    for groups in args.groups:
        driver, floor = time_take_back(colocation, engines, groups, args.samples)
        print(f"{groups:>7} {driver:>12.3f} {floor:>10.3f} {driver / floor:>6.1f}x", flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
