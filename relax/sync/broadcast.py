"""How the training ranks reach each engine: by handle where they share a node or a device, by broadcast elsewhere.

Every training rank of a pipeline stage holds the same buckets of that stage's weights (relax.train.weight_export).
plan_pushes decides, per stage and engine, who sends and how (placement: training rank i on bundle i, engine e
on the bundles of ranks e*k .. (e+1)*k - 1, relax.ray.placement.engine_positions):

- SAME_DEVICE, on every platform, when the stage has a training rank on every device of the engine (slime's
  layout): each of them makes the payload for the engine rank on its own device from its own buckets, and the
  rank on the engine's first device gathers them (a gloo group per engine) and makes the engine's call. Every
  rank sends at once, so a node's push takes one rank's time, not one rank's time per engine. Where handles do
  not cross devices it is also the only same-node route (NPU: SGLang's Ascend path rebuilds a handle on the
  receiver's own device, so a handle from another device would be read as the receiver's own memory; the CPU,
  see relax.platform.cpu).
- SAME_NODE, where the engine's devices hold another stage and the platform's handles cross devices (CUDA:
  SGLang finds a handle's device by its uuid): the stage's first rank hands the engine a payload for each of
  its TP ranks (device IPC handles; relax.sync.bucket).
- BROADCAST otherwise (engines on other nodes; with SAME_DEVICE, also engines whose devices hold another
  stage; every engine when the engines have devices of their own, --no-colocate: plan_broadcasts): the stage's
  first rank broadcasts. A broadcast group never holds two processes of one device (NCCL
  and HCCL refuse that), so an engine must not share the sender's device: the plan refuses such a layout
  (relax.args.checks refuses it at parse time).

The engines a sender broadcasts to join one process group with it and receive each bucket by broadcast,
through SGLang's own distributed weight update (Engine.init_weights_update_group /
update_weights_from_distributed with load_format="flattened_bucket";
sglang/srt/model_executor/model_runner_components/weight_updater.py):

    group rank 0                        the sending training rank
    ranks 1 + i*tp .. 1 + i*tp + tp-1   the TP ranks of remote engine i (tp = devices per engine)

Per bucket, each remote engine allocates the flattened bucket from its names, dtypes and shapes and
receives it by torch.distributed.broadcast from group rank 0, while the sender broadcasts its own
flattened tensor, packed the same way (relax.sync.bucket.flatten_bucket). The group's backend is the
platform's dist_backend: gloo on CPU (SGLang takes the backend as an argument and allocates the receive
buffer on its device, so a CPU engine receives over gloo; tests/e2e/test_multinode_sync.py), nccl / hccl
on devices. The group is made at the first push, reused by every later push, and destroyed on both ends
by close().

    pushes = plan_pushes(stage_of_rank, node_of_rank, engine_tp_size, platform.handles_cross_devices)
    groups = device_groups(pushes)  # collective: every training rank makes every group
    routes = WeightRoutes(engines, pushes, rank, engine_tp_size, platform, group_name, groups)
    routes.send(named_tensors)     # per bucket, inside the engines' begin/end_weight_update
    routes.close()                 # at shutdown
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import ray
import torch

from relax.ports import free_port
from relax.ray.placement import engine_positions, settled
from relax.sync.bucket import bucket_dtypes, bucket_specs, flatten_bucket, serialize_flattened

SAME_NODE = "same_node"
SAME_DEVICE = "same_device"
BROADCAST = "broadcast"


@dataclass(frozen=True)
class Push:
    """How one engine gets the weights of one pipeline stage."""

    stage: int
    engine: int
    route: str  # SAME_NODE, SAME_DEVICE or BROADCAST
    # The training ranks that send: SAME_DEVICE, the stage's ranks on the engine's devices in its TP order (the
    # first gathers and calls the engine); otherwise the stage's first rank alone.
    ranks: tuple[int, ...]


def plan_pushes(stage_of_rank: list[int], node_of_rank: list[str], devices_per_engine: int,
                handles_cross_devices: bool) -> list[Push]:
    """Every (stage, engine) push of one weight sync, from each training rank's pipeline stage and node (see the
    module docstring). Raises ValueError for a layout where a broadcast would put an engine rank on its
    sender's device."""
    if len(stage_of_rank) != len(node_of_rank):
        raise ValueError(f"{len(stage_of_rank)} training ranks' stages but {len(node_of_rank)} nodes")
    pushes = []
    for stage in sorted(set(stage_of_rank)):
        sender = stage_of_rank.index(stage)
        for engine, devices in enumerate(engine_positions(len(stage_of_rank), devices_per_engine)):
            if all(stage_of_rank[rank] == stage for rank in devices):
                pushes.append(Push(stage, engine, SAME_DEVICE, tuple(devices)))
            elif handles_cross_devices and node_of_rank[devices[0]] == node_of_rank[sender]:
                pushes.append(Push(stage, engine, SAME_NODE, (sender,)))
            elif sender in devices:
                raise ValueError(
                    f"engine {engine} shares a device with training rank {sender}, which would broadcast pipeline "
                    f"stage {stage}'s weights to it: engines of {devices_per_engine} devices span pipeline stages "
                    "of other sizes; make --rollout-num-devices-per-engine divide the devices per pipeline stage"
                )
            else:
                pushes.append(Push(stage, engine, BROADCAST, (sender,)))
    return pushes


def plan_broadcasts(stage_of_rank: list[int], num_engines: int) -> list[Push]:
    """Every (stage, engine) push where the engines run on devices of their own (--no-colocate): each stage's
    first rank broadcasts to every engine."""
    return [
        Push(stage, engine, BROADCAST, (stage_of_rank.index(stage),))
        for stage in sorted(set(stage_of_rank))
        for engine in range(num_engines)
    ]


def device_groups(pushes: list[Push]) -> dict[tuple[int, int], object]:
    """A gloo group per SAME_DEVICE push, keyed by (stage, engine). Collective: every training rank makes every
    group, in plan order (a rank outside a group gets torch.distributed's non-member marker for it)."""
    return {
        (push.stage, push.engine): torch.distributed.new_group(list(push.ranks), backend="gloo")
        for push in pushes
        if push.route == SAME_DEVICE
    }


class BroadcastGroup:
    """A process group from this process (rank 0) to `engines` (Ray handles of
    relax.rollout.worker.EngineWorker), made by open() and destroyed by close()."""

    def __init__(self, engines: list, engine_tp_size: int, platform, name: str):
        if not engines:
            raise ValueError("a broadcast group needs at least one engine")
        self.engines = list(engines)
        self.engine_tp_size = engine_tp_size
        self.platform = platform
        self.name = name
        self._group = None

    @property
    def world_size(self) -> int:
        return 1 + len(self.engines) * self.engine_tp_size

    def open(self) -> None:
        """Create the group; every engine joins at the same time. A no-op once open."""
        if self._group is not None:
            return
        self.platform.prepare_sglang()
        # The counterpart of what each engine's TP rank calls (SGLang's WeightUpdater.init_weights_update_group),
        # so both ends agree on the rendezvous (a TCP store on this node, keys prefixed by the group name).
        from sglang.srt.utils import init_custom_process_group

        address, port = ray.util.get_node_ip_address(), free_port(host="")
        joins = [
            engine.init_weights_update_group.remote(
                address, port, 1 + index * self.engine_tp_size, self.world_size, self.name, self.platform.dist_backend
            )
            for index, engine in enumerate(self.engines)
        ]
        # The rendezvous blocks until every member has joined: wait for it beside the engines' answers, so an
        # engine that cannot join raises here (naming why) instead of leaving this rank waiting for it.
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            creating = pool.submit(
                init_custom_process_group,
                backend=self.platform.dist_backend,
                init_method=f"tcp://{address}:{port}",
                world_size=self.world_size,
                rank=0,
                group_name=self.name,
            )
            ray.get(joins)
            self._group = creating.result()
        finally:
            pool.shutdown(wait=False)

    def start_send(self, bucket) -> tuple[list, object]:
        """Start sending one flattened bucket (from flatten_bucket): the engines' receive calls and this
        rank's broadcast. Returns (receive refs, broadcast work); ray.get the refs, then wait on the work."""
        if self._group is None:
            raise RuntimeError(f"broadcast group {self.name!r} is not open: call open() first")
        specs, dtypes = bucket_specs(bucket), bucket_dtypes(bucket)
        receives = [engine.update_weights_from_distributed.remote(specs, dtypes, self.name) for engine in self.engines]
        work = torch.distributed.broadcast(bucket.get_flattened_tensor(), group=self._group, group_src=0, async_op=True)
        return receives, work

    def close(self) -> None:
        """Destroy the group on every engine and here. Idempotent."""
        self.rebuild(self.engines)

    def rebuild(self, engines: list) -> None:
        """Broadcast to `engines` from now on: where an engine was restarted in place, the group is
        destroyed on the engines that were in it and still run, and here; the next open() builds it anew."""
        old_engines, self.engines = self.engines, list(engines)
        if self._group is None:
            return
        group, self._group = self._group, None
        ray.get([
            engine.destroy_weights_update_group.remote(self.name) for engine in old_engines if engine in self.engines
        ])
        torch.distributed.destroy_process_group(group)


class WeightRoutes:
    """What one training rank (`rank`) does with each bucket of its stage under the plan `pushes`: the payloads
    of engines on its node (SAME_NODE), one BroadcastGroup (named `group_name`; unique per sender) to the
    engines it broadcasts to, and its payload for the engine rank on its own device (SAME_DEVICE, through
    that push's group from device_groups)."""

    def __init__(self, engines: list, pushes: list[Push], rank: int, engine_tp_size: int, platform, group_name: str,
                 groups: dict[tuple[int, int], object]):
        platform.prepare_sglang()  # before the buckets import sglang
        self.engines = list(engines)
        self.rank = rank
        self.engine_tp_size = engine_tp_size
        self.platform = platform
        mine = [push for push in pushes if rank in push.ranks]
        self.routes = [None] * len(engines)  # per engine, the route this rank sends it on
        for push in mine:
            self.routes[push.engine] = push.route
        self._same_node = [push.engine for push in mine if push.route == SAME_NODE]
        remote = [engines[push.engine] for push in mine if push.route == BROADCAST]
        self.broadcast = BroadcastGroup(remote, engine_tp_size, platform, group_name) if remote else None
        # At most one: the rank's device holds one engine rank, and the rank one stage.
        own_device = [push for push in mine if push.route == SAME_DEVICE]
        self.same_device = own_device[0] if own_device else None
        self.device_group = groups[(self.same_device.stage, self.same_device.engine)] if self.same_device else None

    @property
    def sends(self) -> bool:
        return any(route is not None for route in self.routes)

    def follow(self, engines: list) -> None:
        """Send to `engines` from now on: the same engines as planned, but where one was restarted in place
        (relax.run.colocation) the new actor on its devices. A broadcast group that held a replaced
        engine is destroyed (on its surviving engines and here) and built again at the next send."""
        if len(engines) != len(self.engines):
            raise ValueError(f"{len(engines)} engines, but the weight routes were planned for {len(self.engines)}")
        replaced = [old for old, new in zip(self.engines, engines) if old != new]
        if self.broadcast is not None and any(engine in self.broadcast.engines for engine in replaced):
            self.broadcast.rebuild([engines[self.engines.index(engine)] for engine in self.broadcast.engines])
        self.engines = list(engines)

    def send(self, named_tensors: list[tuple[str, torch.Tensor]]) -> list[Exception]:
        """Push one bucket of (HF name, tensor) on this rank's routes; returns once every engine it serves has
        loaded it or failed (the bucket's memory may then be reused), with the failures (settled). The engines'
        weight update must be open."""
        if self.broadcast is not None:
            self.broadcast.open()
        bucket = flatten_bucket(named_tensors)
        pending, work = [], None
        if self._same_node:
            specs, payloads = bucket_specs(bucket), serialize_flattened(bucket, self.platform, self.engine_tp_size)
            pending += [
                self.engines[engine].update_weights_from_serialized_bucket.remote(specs, payloads)
                for engine in self._same_node
            ]
        if self.broadcast is not None:
            receives, work = self.broadcast.start_send(bucket)
            pending += receives
        if self.same_device is not None:
            pending += self._give_own_device_payload(bucket)
        failures = settled(pending)  # a refused bucket, a dead engine: the other engines still get theirs
        if work is not None:
            work.wait()
        if self.same_device is not None:  # every rank keeps its bucket until the engine has copied them all
            torch.distributed.barrier(group=self.device_group)
        return failures

    def _give_own_device_payload(self, bucket) -> list:
        """This rank's payload for the engine rank on its device, gathered by the rank on the engine's first
        device, which starts the engine's update (the ref it returns); the others return none."""
        (payload,) = serialize_flattened(bucket, self.platform, tp_size=1)
        caller = self.same_device.ranks[0]
        payloads = [None] * len(self.same_device.ranks) if self.rank == caller else None
        torch.distributed.gather_object(payload, payloads, dst=caller, group=self.device_group)
        if self.rank != caller:
            return []
        engine = self.engines[self.same_device.engine]
        return [engine.update_weights_from_serialized_bucket.remote(bucket_specs(bucket), payloads)]

    def close(self) -> None:
        if self.broadcast is not None:
            self.broadcast.close()
        if self.device_group is not None:
            group, self.device_group = self.device_group, None
            torch.distributed.destroy_process_group(group)
