"""Placement: one placement group of device bundles, ordered by node and device, and the actors on it.

    placement = create_placement(platform, num_devices=8)           # bundles sorted by node, then device
    placement = create_node_placement(platform, num_nodes=2, devices_per_node=8)   # and checked per node
    trainers = create_training_actors(TrainActor, placement)         # rank i on bundle i, share 0.4
    engines = create_engine_actors(Engine, placement, devices_per_engine=2)   # share 0.2 of its first bundle
    ...
    engines.kill(); trainers.kill(); placement.remove()

A bundle holds one device ({"GPU": 1, "CPU": c} / {"NPU": 1, "CPU": c}) or, on the CPU platform, CPUs
only ({"CPU": c}). Colocated, training actors and engines each take a fraction (`share`) of every resource of
its bundle, so a training rank and an engine live on the same device; with --no-colocate the training ranks take
the first bundles and the engines the rest (Placement.part).

Devices: Ray names a bundle's device by its entry in the node's visible-devices list (the raylet's
CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES when set, else 0..n-1): the physical id. Every actor here
starts with Ray's RAY_EXPERIMENTAL_NOSET_<visible-devices variable>, so Ray leaves that variable as the
raylet has it and each process of a node sees the same devices in the same order; an actor then selects
its device by the logical index (its position in that list), given to it in RELAX_LOCAL_DEVICE. Engines
get the logical index of their first device (SGLang's base_gpu_id) and of all of theirs.
"""

import ipaddress
import os
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from relax.platform import Platform
from relax.ports import free_port
from relax.ray.runtime_env import worker_env_vars
from relax.ray.watch import ProcessWatcher, Timeout, process_records

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

# Variables relax sets in the actors it places (besides torch.distributed's MASTER_ADDR, MASTER_PORT,
# RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE for training ranks).
LOCAL_DEVICE_ENV = "RELAX_LOCAL_DEVICE"  # logical index of the actor's (first) device; unset on CPU
ENGINE_RANK_ENV = "RELAX_ENGINE_RANK"
NUM_ENGINES_ENV = "RELAX_NUM_ENGINES"
ENGINE_DEVICES_ENV = "RELAX_ENGINE_DEVICES"  # logical indices of all of an engine's devices, comma-separated
_PER_ACTOR_ENV = (LOCAL_DEVICE_ENV, ENGINE_RANK_ENV, NUM_ENGINES_ENV, ENGINE_DEVICES_ENV)

TRAINING_RANK = "training rank"  # the role of create_training_actors' actors, in messages and WorkerFailed
ENGINE = "engine"  # the role of create_engine_actors' actors

_WAIT_POLL_S = 1.0

# What a probe takes of its bundle: enough to be given the bundle's device, little enough to fit beside
# anything (Ray counts resources in units of 1e-4).
_PROBE_SHARE = 0.01


def noset_visible_devices_env(platform) -> dict[str, str]:
    """Ray's switch that keeps it from narrowing the platform's visible-devices variable per actor."""
    if platform.visible_devices_env is None:
        return {}
    return {f"RAY_EXPERIMENTAL_NOSET_{platform.visible_devices_env}": "1"}


def local_device_index(environ=os.environ) -> int:
    """The device index an actor placed here should select (platform.set_device): 0 on the CPU platform."""
    return int(environ.get(LOCAL_DEVICE_ENV, "0"))


@dataclass(frozen=True)
class Bundle:
    index: int  # the bundle's index in the placement group
    node_id: str
    node_ip: str
    device_id: str | None  # Ray's (physical) id of the bundle's device; None on the CPU platform
    local_device: int | None  # its logical index for a process that sees all of the node's devices


@dataclass
class Placement:
    platform: Platform
    group: PlacementGroup
    bundle_resources: dict[str, float]
    bundles: list[Bundle]  # ordered by node (IP, then node id), then device
    master_addr: str  # for torch.distributed: the node of the first bundle
    master_port: int  # a port that was free on that node when the placement was made
    # The ActorGroups placed here and not killed: wait_for(refs, placement) watches their actors.
    groups: list = field(default_factory=list, repr=False)

    @property
    def num_devices(self) -> int:
        return len(self.bundles)

    def node_ids(self) -> list[str]:
        """The nodes in bundle order, each once."""
        return list(dict.fromkeys(bundle.node_id for bundle in self.bundles))

    def local_ranks(self) -> list[tuple[int, int]]:
        """(local rank, local world size) of each bundle: its position among the bundles of its node."""
        sizes = Counter(bundle.node_id for bundle in self.bundles)
        seen: Counter = Counter()
        ranks = []
        for bundle in self.bundles:
            ranks.append((seen[bundle.node_id], sizes[bundle.node_id]))
            seen[bundle.node_id] += 1
        return ranks

    def part(self, start: int, stop: int) -> "Placement":
        """Bundles start .. stop - 1 as a placement of their own for the actors created on it (--no-colocate: the
        actor's and the engines' devices): the same placement group, removed with the whole, and the same groups,
        so a wait watches the actors of both parts. torch.distributed's master stays the whole one's: a part for
        training ranks starts at bundle 0."""
        return replace(self, bundles=self.bundles[start:stop], groups=self.groups)

    def remove(self) -> None:
        remove_placement_group(self.group)


class _BundleProbe:
    """Reports where the bundle it runs in lives; one per bundle, killed once the bundles are sorted."""

    def where(self, ray_resource: str | None, visible_devices_env: str | None) -> dict:
        context = ray.get_runtime_context()
        device_id = local_device = None
        if ray_resource is not None:
            (device_id,) = context.get_accelerator_ids()[ray_resource]
            # With NOSET this process sees the raylet's list; Ray's ids are entries of that list.
            visible = os.environ.get(visible_devices_env or "")
            local_device = visible.split(",").index(device_id) if visible else int(device_id)
        return {
            "node_id": context.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "device_id": device_id,
            "local_device": local_device,
        }

    def free_port(self) -> int:
        return free_port(host="")  # torch.distributed's master port: ranks on other nodes connect to it


def bundle_sort_key(bundle: Bundle) -> tuple:
    """Node IP (numerically; a hostname after all addresses), node id, then device id (numerically)."""
    try:
        address = ipaddress.ip_address(bundle.node_ip)
        node_key = (0, address.version, int(address), "")
    except ValueError:
        node_key = (1, 0, 0, bundle.node_ip)
    device = bundle.device_id
    device_key = (0, int(device), "") if device is not None and device.isdigit() else (1, 0, device or "")
    return (node_key, bundle.node_id, device_key, bundle.index)


def bundle_resources_for(platform, cpus_per_device: float) -> dict[str, float]:
    if platform.ray_resource is None:
        return {"CPU": cpus_per_device}
    return {platform.ray_resource: 1, "CPU": cpus_per_device}


def create_placement(
    platform,
    num_devices: int,
    cpus_per_device: float = 1,
    strategy: str = "PACK",
    timeout_s: float = 300,
) -> Placement:
    """Reserve `num_devices` bundles (PACK: as few nodes as possible) and order them by node and device.

    Needs ray.init() done. Fails with the cluster's resources named when they cannot hold the bundles.
    """
    if num_devices < 1:
        raise ValueError(f"create_placement: num_devices must be at least 1, got {num_devices}")
    if strategy not in STRATEGIES:
        raise ValueError(f"create_placement: strategy {strategy!r} is not one of {', '.join(STRATEGIES)}")
    resources = bundle_resources_for(platform, cpus_per_device)
    total = ray.cluster_resources()
    for name, amount in resources.items():
        if total.get(name, 0) < amount * num_devices:
            raise RuntimeError(
                f"placement: {num_devices} bundles of {resources} need {amount * num_devices:g} {name}, "
                f"but the Ray cluster has {total.get(name, 0):g} {name} in all ({len(ray.nodes())} nodes); "
                "ask for fewer devices or add nodes"
            )
    group = placement_group([dict(resources)] * num_devices, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"placement: {num_devices} bundles of {resources} ({strategy}) were not granted within {timeout_s:g} s; "
            f"the cluster has {ray.available_resources()} free now (other jobs may hold the rest)"
        )
    try:
        return _probe_and_sort(platform, group, resources)
    except BaseException:
        remove_placement_group(group)
        raise


def create_node_placement(
    platform, num_nodes: int, devices_per_node: int, engine_devices: int = 0, **options
) -> Placement:
    """`num_nodes` x `devices_per_node` bundles (relax train's --num-nodes / --num-devices-per-node), checked,
    then `engine_devices` more (--no-colocate's --rollout-num-devices: Placement.part splits them off).

    Ray has no "n bundles on each node" strategy: one device per node is spread strictly, more are packed (a
    node whose Ray resources hold exactly `devices_per_node` devices then takes that many bundles). The layout
    Ray granted to the first num_nodes x devices_per_node bundles is checked, so a node with room for more
    bundles cannot silently take another node's share.
    """
    actor_devices = num_nodes * devices_per_node
    strategy = "STRICT_SPREAD" if devices_per_node == 1 and num_nodes > 1 and not engine_devices else "PACK"
    placement = create_placement(platform, actor_devices + engine_devices, strategy=strategy, **options)
    problem = node_layout_problem(placement.bundles[:actor_devices], num_nodes, devices_per_node)
    if problem:
        placement.remove()
        raise RuntimeError(problem)
    return placement


def node_layout_problem(bundles: list[Bundle], num_nodes: int, devices_per_node: int) -> str | None:
    """What is wrong with granted bundles for a `num_nodes` x `devices_per_node` run, or None."""
    per_node = Counter(bundle.node_id for bundle in bundles)
    if len(per_node) == num_nodes and set(per_node.values()) == {devices_per_node}:
        return None
    granted = ", ".join(f"{count} on node {node[:8]}" for node, count in per_node.items())
    return (
        f"placement: --num-nodes {num_nodes} --num-devices-per-node {devices_per_node} asked for "
        f"{devices_per_node} bundle(s) on each of {num_nodes} node(s), but Ray granted {granted}; "
        f"give each node exactly {devices_per_node} device(s) in its Ray resources (ray start --num-gpus / "
        "--resources), or set --num-nodes and --num-devices-per-node to the cluster's real layout"
    )


def _probe_and_sort(platform, group: PlacementGroup, resources: dict[str, float]) -> Placement:
    probe_class = ray.remote(_BundleProbe)
    probes = [
        probe_class.options(
            **_resource_options({name: amount * _PROBE_SHARE for name, amount in resources.items()}),
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=index),
            runtime_env={"env_vars": noset_visible_devices_env(platform)},
        ).remote()
        for index in range(len(group.bundle_specs))
    ]
    try:
        reports = ray.get([probe.where.remote(platform.ray_resource, platform.visible_devices_env) for probe in probes])
        bundles = sorted(
            (Bundle(index=index, **report) for index, report in enumerate(reports)), key=bundle_sort_key
        )
        master_port = ray.get(probes[bundles[0].index].free_port.remote())
    finally:
        for probe in probes:
            ray.kill(probe)
    return Placement(
        platform=platform,
        group=group,
        bundle_resources=dict(resources),
        bundles=bundles,
        master_addr=bundles[0].node_ip,
        master_port=master_port,
    )


def _resource_options(resources: dict[str, float]) -> dict:
    """Ray's actor options for a resource dict: CPU and GPU have keywords of their own, the rest go in `resources`."""
    options = {"num_cpus": resources.get("CPU", 0), "num_gpus": resources.get("GPU", 0)}
    custom = {name: amount for name, amount in resources.items() if name not in ("CPU", "GPU")}
    if custom:
        options["resources"] = custom
    return options


class WorkerFailed(RuntimeError):
    """A placed actor died, raised or did not answer in time; the message names it, where it ran and where its
    log is. `group` and `index` say which actor it is and `role` its group's role ("training rank", "engine"); all
    None when the failure names no single actor. `role` alone serves a failure reported without its group."""

    def __init__(
        self, message: str, group: "ActorGroup | None" = None, index: int | None = None, role: str | None = None
    ):
        super().__init__(message)
        self.group, self.index = group, index
        self.role = group.role if group is not None else role


class ActorGroup:
    """Ray actors of one class: actor i on bundle `placement.bundles[positions[i]]`, taking `share` of each
    resource of that bundle, with environment `envs[i]` (on top of the job's). All get the same init args;
    `ray_options` go to Ray's .options() as they are (e.g. max_concurrency). `role` names the actors in
    messages ("engine 0", "training rank 1")."""

    def __init__(self, actor_class, placement: Placement, positions: list[int], share: float,
                 envs: list[dict[str, str]], args: tuple = (), kwargs: dict | None = None,
                 ray_options: dict | None = None, role: str = "actor"):
        if len(positions) != len(envs):
            raise ValueError(f"ActorGroup: {len(positions)} bundle positions but {len(envs)} environments")
        if not 0 < share <= 1:
            raise ValueError(f"ActorGroup: share must be in (0, 1], got {share}")
        self.placement = placement
        self.envs = envs
        self.role = role
        self.bundles = [placement.bundles[position] for position in positions]
        if not isinstance(actor_class, ray.actor.ActorClass):  # a plain class may carry its ray.remote options
            options = getattr(actor_class, "RAY_OPTIONS", None)
            actor_class = ray.remote(**options)(actor_class) if options else ray.remote(actor_class)
        self._remote_class = actor_class
        self.class_name = self._remote_class.__ray_metadata__.class_name
        self._options = {
            **_resource_options({name: amount * share for name, amount in placement.bundle_resources.items()}),
            **(ray_options or {}),
        }
        self._args, self._kwargs = args, kwargs or {}
        self.actors = [self._start_actor(index) for index in range(len(self.bundles))]
        # Asked now, answered once each actor is up (after its __init__): to name a failed actor, and the
        # processes the liveness watch polls.
        self._whereabouts = [actor.__ray_call__.remote(_whereabouts) for actor in self.actors]
        self._watches: dict = {}  # watch ref -> its ProcessWatcher, one per node (started by watch())
        # The groups whose actors a wait on this group's calls watches (None: every group of the placement).
        self.watched: list["ActorGroup"] | None = None
        placement.groups.append(self)

    def _start_actor(self, index: int):
        """A new actor `index` of the group, on its bundle with its environment and the group's init args."""
        return self._remote_class.options(
            **self._options,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement.group, placement_group_bundle_index=self.bundles[index].index
            ),
            runtime_env={"env_vars": self.envs[index]},
        ).remote(*self._args, **self._kwargs)

    def __len__(self) -> int:
        return len(self.actors)

    def call(self, method: str, *args, **kwargs) -> list:
        """Call `method` on every actor; returns the object refs (ray.get them)."""
        return [getattr(actor, method).remote(*args, **kwargs) for actor in self.actors]

    def run(self, method: str, *args, timeout: Timeout | None = None, **kwargs) -> list:
        """Call `method` on every actor and wait for their answers, in actor order (wait): WorkerFailed as soon
        as a watched actor is gone, or naming the first of these actors still silent after `timeout`."""
        return self.wait(self.call(method, *args, **kwargs), timeout)

    def wait(self, refs: list, timeout: Timeout | None = None) -> list:
        """wait_for(refs), ref i of a call on actor i, watching `self.watched` (every group of the placement
        when None)."""
        return wait_for(refs, self.placement, timeout, group_callees(self), self.watched)

    def kill(self) -> None:
        self._end_watches()  # first: they would report the actors' deaths
        for actor in self.actors:
            ray.kill(actor)
        if self in self.placement.groups:
            self.placement.groups.remove(self)

    def restart(self, index: int) -> None:
        """Kill actor `index` (whatever state it is in) and start a new one in its place: the same bundle,
        environment and init args. Returns at once; the new actor is up once a call on it answers."""
        self._end_watches()  # they watch the old actor's processes; the next watch() watches the new one's
        ray.kill(self.actors[index])
        self.actors[index] = self._start_actor(index)
        self._whereabouts[index] = self.actors[index].__ray_call__.remote(_whereabouts)

    def _end_watches(self) -> None:
        for watcher in self._watches.values():
            ray.kill(watcher)
        self._watches = {}

    def watch(self) -> list:
        """Refs that stay pending while every actor of the group runs, with the processes it cannot work
        without (relax.ray.watch); one per node, it completes within about a second of such a process's
        end. Started at the first call (a ProcessWatcher actor on each node, no CPU taken), ended by kill()."""
        if not self._watches:
            for node_id in dict.fromkeys(bundle.node_id for bundle in self.bundles):
                indices = [index for index, bundle in enumerate(self.bundles) if bundle.node_id == node_id]
                watcher = ray.remote(ProcessWatcher).options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
                ).remote()
                self._watches[watcher.watch.remote(indices, *(self._whereabouts[i] for i in indices))] = watcher
        return list(self._watches)

    def watch_failure(self, ref) -> "WorkerFailed":
        """What a completed watch ref of this group (from watch()) says: which actor is gone, or why the
        watch itself ended."""
        try:
            gone = ray.get(ref)
        except ray.exceptions.RayError as error:  # an actor died in its __init__, or the watcher died
            failure = worker_failure(error, [self])
            if isinstance(failure, WorkerFailed):
                return failure
            return WorkerFailed(f"the liveness watch of the {self.role}s on one node ended (the node lost?): {error}")
        what = "its process" if gone["own"] else f"its process {gone['title']!r}"
        index = gone["index"]
        return WorkerFailed(f"{self.describe(index)} failed: {what} (pid {gone['pid']}) {gone['state']}", self, index)

    def describe(self, index: int) -> str:
        """`engine 0 (EngineWorker, pid 123 on 10.0.0.1; log: .../worker-...-123.err, .out beside it)`, as far
        as known (an actor that died in its __init__ never said where it runs)."""
        actor = self.actors[index]
        facts = [self.class_name]
        ready, _ = ray.wait([self._whereabouts[index]], timeout=0)
        try:
            where = ray.get(ready[0]) if ready else None
        except ray.exceptions.RayError:
            where = None
        if where is None:
            facts.append(f"actor id {actor._actor_id.hex()}")
        else:
            facts.append(f"pid {where['pid']} on {where['node_ip']}")
            if where["log"]:
                facts[-1] += f"; log: {where['log']}.err, .out beside it"
        return f"{self.role} {index} ({', '.join(facts)})"


def _whereabouts(actor) -> dict:
    """Where the actor this runs in (through Ray's __ray_call__) runs and logs, and the processes the
    liveness watch polls: its own, then those its `watched_child_pids()` names, if it has that method
    (relax.ray.watch). Ray points an actor's stdout and stderr at its log files, worker-<id>-<job>-<pid>.out
    and .err."""
    try:
        log = os.readlink("/proc/self/fd/2")
    except OSError:
        log = ""
    children = actor.watched_child_pids() if hasattr(actor, "watched_child_pids") else []
    return {
        "pid": os.getpid(),
        "node_ip": ray.util.get_node_ip_address(),
        "log": log.removesuffix(".err") if log.endswith(".err") else "",
        "processes": process_records([os.getpid(), *children]),
    }


def wait_for(refs: list, placement: Placement, timeout: Timeout | None = None,
             callees: list[tuple["ActorGroup", int]] | None = None, watched: list["ActorGroup"] | None = None) -> list:
    """ray.get(refs), while watching the actors of the groups `watched` (every group on `placement` when None;
    ActorGroup.watch): raises WorkerFailed as soon as one of them is gone, instead of waiting on refs that may
    never complete, or complete only for the driver to meet the dead worker at its next call, a phase later. A
    ref that fails raises as ray.get raises it, at once.

    With a `timeout`, a ref still pending after timeout.seconds raises WorkerFailed naming the actor it
    was called on (`callees`: (group, index) per ref; group_callees(group) for refs from group.call)."""
    deadline = None if timeout is None or timeout.seconds is None else time.monotonic() + timeout.seconds
    pending = list(refs)
    while pending:
        ref = first_done(pending, placement, [deadline] * len(pending), timeout,
                         None if callees is None else [callees[refs.index(ref)] for ref in pending], watched)
        ray.get(ref)
        pending.remove(ref)
    return ray.get(refs)


def first_done(refs: list, placement: Placement, deadlines: list[float | None], timeout: Timeout | None = None,
               callees: list[tuple["ActorGroup", int]] | None = None, watched: list["ActorGroup"] | None = None):
    """The first of `refs` to be done (ray.get it: it may hold an error), watching as wait_for does. Ref i past
    its time.monotonic() deadline `deadlines[i]` (None: none) while pending raises WorkerFailed naming its callee
    and `timeout` (what set the deadline)."""
    watches = {ref: group for group in (placement.groups if watched is None else watched) for ref in group.watch()}
    while True:
        late = [i for i, deadline in enumerate(deadlines) if deadline is not None and time.monotonic() > deadline]
        if late:
            raise _timed_out(late[0], timeout, callees)
        # With a timeout, the driver's Python signal handlers run between the waits.
        ready, _ = ray.wait(list(refs) + list(watches), num_returns=1, timeout=_WAIT_POLL_S)
        for ref in ready:
            if ref in watches:
                raise watches[ref].watch_failure(ref)
            return ref


def settled(refs: list) -> list[ray.exceptions.RayError]:
    """Wait until every ref is done; the errors of those that failed, in ref order (where ray.get(refs) would
    raise at the first and leave the others running)."""
    failures = []
    for ref in refs:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as error:
            failures.append(error)
    return failures


def group_callees(group: "ActorGroup") -> list[tuple["ActorGroup", int]]:
    """wait_for's callees for the refs of group.call(...): actor i for ref i."""
    return [(group, index) for index in range(len(group))]


def _timed_out(position: int, timeout: Timeout, callees) -> WorkerFailed:
    if callees is None:
        return WorkerFailed(f"a call did not answer within {timeout.describe()}")
    group, index = callees[position]
    return WorkerFailed(f"{group.describe(index)} did not answer within {timeout.describe()}", group, index)


def worker_failure(error: ray.exceptions.RayError, groups: list) -> Exception:
    """A WorkerFailed naming the actor of `groups` (ActorGroups or None) where `error` started, with Ray's
    account of why; `error` itself when it names none of them.

    A worker whose call on another one failed (a rank pushing weights to an engine that died or raised)
    raises that one's error, which Ray relays as the cause of its own: the innermost is where it started.
    A task error comes back from ray.get as Ray's own exception type, which carries the failed actor's id
    only in its text, in a header per actor the error passed through ("ray::Class.method() (pid=...,
    actor_id=...)"), outermost first; a worker that re-raises another's task error keeps only the innermost
    exception as the cause, so the last header names where it started. An actor's death carries its id as
    actor_id."""
    origin = error
    while isinstance(getattr(origin, "cause", None), ray.exceptions.RayError):
        origin = origin.cause
    groups = [group for group in groups if group is not None]
    actors = [(group, index, actor._actor_id.hex()) for group in groups for index, actor in enumerate(group.actors)]
    if isinstance(origin, ray.exceptions.RayActorError):
        named = [(group, index) for group, index, actor_id in actors if actor_id == origin.actor_id]
        reason = str(origin)
    else:
        text = str(origin)
        headers = [(text.rfind(f"actor_id={actor_id}"), group, index) for group, index, actor_id in actors]
        named = [max(headers, key=lambda found: found[0])[1:]] if any(at >= 0 for at, _, _ in headers) else []
        cause = getattr(origin, "cause", None)
        reason = f"{type(cause).__name__}: {cause}" if cause is not None else text
    if not named:
        return error
    group, index = named[0]
    return WorkerFailed(f"{group.describe(index)} failed: {reason}", group, index)


def _base_env(placement: Placement, env: dict | None, memory_saver_on: bool) -> dict[str, str]:
    """The worker environment of this driver's run with the caller's variables, and Ray's NOSET switch.

    Per-actor variables are dropped: a driver that is itself a placed actor must not hand its own on."""
    base = worker_env_vars(placement.platform, os.environ, named=env, memory_saver_on=memory_saver_on)
    for name in _PER_ACTOR_ENV:
        base.pop(name, None)
    return {**base, **noset_visible_devices_env(placement.platform)}


def training_envs(placement: Placement, base_env: dict[str, str]) -> list[dict[str, str]]:
    """torch.distributed's variables for rank i on bundle i (bundles in node/device order)."""
    envs = []
    for rank, (bundle, (local_rank, local_size)) in enumerate(zip(placement.bundles, placement.local_ranks())):
        env = {
            **base_env,
            "MASTER_ADDR": placement.master_addr,
            "MASTER_PORT": str(placement.master_port),
            "RANK": str(rank),
            "WORLD_SIZE": str(placement.num_devices),
            "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_size),
        }
        if bundle.local_device is not None:
            env[LOCAL_DEVICE_ENV] = str(bundle.local_device)
        envs.append(env)
    return envs


def engine_positions(num_devices: int, devices_per_engine: int) -> list[range]:
    """The bundle positions of each engine: engine e on [e*k, (e+1)*k) (k = devices_per_engine). Training rank i
    runs on position i, so engine e shares its devices with training ranks e*k .. (e+1)*k - 1, its TP rank r with
    rank e*k + r (relax.sync.broadcast routes weight pushes by it)."""
    if devices_per_engine < 1 or num_devices % devices_per_engine:
        raise ValueError(
            f"rollout_num_devices_per_engine={devices_per_engine} must divide the {num_devices} placed devices"
        )
    return [range(start, start + devices_per_engine) for start in range(0, num_devices, devices_per_engine)]


def placement_plan(num_nodes: int, devices_per_node: int, devices_per_engine: int, engine_devices: int | None,
                   with_actor: bool = True, with_engines: bool = True) -> list[str]:
    """What --dry-run shows of the placement the run will make: which bundles (one device each; Ray CPU bundles on
    the CPU platform), in node and device order, the training ranks and each engine take. `engine_devices`:
    --rollout-num-devices (--no-colocate), after the actor's; None: the engines share the actor's (colocated); 0:
    the engines run beside the actor on its. `with_actor`, `with_engines`: whether the run starts them (not in the
    debug modes)."""
    actor_devices = num_nodes * devices_per_node
    first_engine_bundle = actor_devices if engine_devices else 0
    engines = [
        range(first_engine_bundle + devices.start, first_engine_bundle + devices.stop)
        for devices in engine_positions(engine_devices or actor_devices, devices_per_engine)
    ]
    total = actor_devices + (engine_devices or 0)
    how = {None: "shared by the actor and the engines", 0: "the actor and the engines side by side"}.get(
        engine_devices, "the actor's, then the engines'"
    )
    lines = [f"placement: {total} bundle(s) ({how})"]
    if with_actor:
        lines.append(
            f"  training ranks 0-{actor_devices - 1}: bundles 0-{actor_devices - 1} ({num_nodes} node(s) x "
            f"{devices_per_node})"
        )
    if with_engines:
        lines += [f"  engine {index}: bundles {range_.start}-{range_.stop - 1}" for index, range_ in enumerate(engines)]
    return lines


def engine_envs(placement: Placement, devices_per_engine: int, base_env: dict[str, str]) -> list[dict[str, str]]:
    """Engine e runs on bundles engine_positions(...)[e], all on one node, consecutive devices."""
    positions = engine_positions(placement.num_devices, devices_per_engine)
    num_engines = len(positions)
    envs = []
    for engine in range(num_engines):
        bundles = [placement.bundles[position] for position in positions[engine]]
        if len({bundle.node_id for bundle in bundles}) > 1:
            per_node = dict(Counter(f"{bundle.node_ip}/{bundle.node_id[:8]}" for bundle in placement.bundles))
            raise ValueError(
                f"engine {engine} would span nodes: rollout_num_devices_per_engine={devices_per_engine} must divide "
                f"the devices placed on each node (here, by node IP/id: {per_node})"
            )
        env = {**base_env, ENGINE_RANK_ENV: str(engine), NUM_ENGINES_ENV: str(num_engines)}
        if bundles[0].local_device is not None:
            devices = [bundle.local_device for bundle in bundles]
            # SGLang places tensor-parallel rank r on base_gpu_id + r: the devices must be consecutive.
            if devices != list(range(devices[0], devices[0] + len(devices))):
                raise ValueError(
                    f"engine {engine} got devices {devices} on node {bundles[0].node_ip}, not consecutive; "
                    "SGLang needs consecutive devices per engine (another job may hold the ones between)"
                )
            env[LOCAL_DEVICE_ENV] = str(devices[0])
            env[ENGINE_DEVICES_ENV] = ",".join(map(str, devices))
        envs.append(env)
    return envs


def create_training_actors(actor_class, placement: Placement, share: float = 0.4, env: dict | None = None,
                           memory_saver_on: bool = False, args: tuple = (), kwargs: dict | None = None,
                           ray_options: dict | None = None) -> ActorGroup:
    """One actor per bundle: rank i on bundle i, with torch.distributed's variables."""
    envs = training_envs(placement, _base_env(placement, env, memory_saver_on))
    positions = list(range(placement.num_devices))
    return ActorGroup(actor_class, placement, positions, share, envs, args, kwargs, ray_options, role=TRAINING_RANK)


def create_engine_actors(actor_class, placement: Placement, devices_per_engine: int, share: float = 0.2,
                         env: dict | None = None, memory_saver_on: bool = False, args: tuple = (),
                         kwargs: dict | None = None, ray_options: dict | None = None) -> ActorGroup:
    """One actor per group of `devices_per_engine` bundles, on the first bundle of its group."""
    envs = engine_envs(placement, devices_per_engine, _base_env(placement, env, memory_saver_on))
    positions = [engine[0] for engine in engine_positions(placement.num_devices, devices_per_engine)]
    return ActorGroup(actor_class, placement, positions, share, envs, args, kwargs, ray_options, role=ENGINE)
