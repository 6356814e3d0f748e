"""How a sending training rank reaches each engine: by handle on its own node, by a broadcast group elsewhere.

Engines on the sender's node take each bucket as a payload (device IPC handles on GPU/NPU, the bytes on
CPU; relax.sync.bucket). Handles do not cross nodes, so the engines on other nodes join one
process group with the sender and receive each bucket by broadcast, through SGLang's own distributed
weight update (Engine.init_weights_update_group / update_weights_from_distributed with
load_format="flattened_bucket"; sglang/srt/model_executor/model_runner_components/weight_updater.py):

    group rank 0                        the sending training rank
    ranks 1 + i*tp .. 1 + i*tp + tp-1   the TP ranks of remote engine i (tp = devices per engine)

Per bucket, each remote engine allocates the flattened bucket from its names, dtypes and shapes and
receives it by torch.distributed.broadcast from group rank 0, while the sender broadcasts its own
flattened tensor, packed the same way (relax.sync.bucket.flatten_bucket). The group's backend is the
platform's dist_backend: gloo on CPU (SGLang takes the backend as an argument and allocates the receive
buffer on its device, so a CPU engine receives over gloo; tests/e2e/test_multinode_sync.py), nccl / hccl
on devices. The group is made at the first push, reused by every later push, and destroyed on both ends
by close().

    routes = WeightRoutes(engines, engine_nodes, own_node, engine_tp_size, platform, group_name)
    routes.send(named_tensors)     # per bucket, inside the engines' begin/end_weight_update
    routes.close()                 # at shutdown
"""

from concurrent.futures import ThreadPoolExecutor

import ray
import torch

from relax.ports import free_port
from relax.sync.bucket import bucket_dtypes, bucket_specs, flatten_bucket, serialize_flattened

SAME_NODE = "same_node"
BROADCAST = "broadcast"


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
        if self._group is None:
            return
        group, self._group = self._group, None
        ray.get([engine.destroy_weights_update_group.remote(self.name) for engine in self.engines])
        torch.distributed.destroy_process_group(group)


class WeightRoutes:
    """The engines one sending training rank pushes to, split by node: those on `own_node` by handle, the
    others through one BroadcastGroup (named `group_name`; unique per sender)."""

    def __init__(self, engines: list, engine_nodes: list[str], own_node: str, engine_tp_size: int, platform,
                 group_name: str):
        if len(engines) != len(engine_nodes):
            raise ValueError(f"{len(engines)} engines but {len(engine_nodes)} engine node ids")
        platform.prepare_sglang()  # before the buckets import sglang
        self.engines = list(engines)
        self.engine_tp_size = engine_tp_size
        self.platform = platform
        self.routes = [SAME_NODE if node == own_node else BROADCAST for node in engine_nodes]
        self.same_node = [engine for engine, route in zip(engines, self.routes) if route == SAME_NODE]
        remote = [engine for engine, route in zip(engines, self.routes) if route == BROADCAST]
        self.broadcast = BroadcastGroup(remote, engine_tp_size, platform, group_name) if remote else None

    def serves(self, engines: list) -> bool:
        return list(engines) == self.engines

    def send(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Push one bucket of (HF name, tensor) to every engine; returns once every engine has loaded it
        (the bucket's memory may then be reused). The engines' weight update must be open."""
        if self.broadcast is not None:
            self.broadcast.open()
        bucket = flatten_bucket(named_tensors)
        pending, work = [], None
        if self.same_node:
            specs, payloads = bucket_specs(bucket), serialize_flattened(bucket, self.platform, self.engine_tp_size)
            pending += [engine.update_weights_from_serialized_bucket.remote(specs, payloads) for engine in self.same_node]
        if self.broadcast is not None:
            receives, work = self.broadcast.start_send(bucket)
            pending += receives
        # A refused bucket or a dead engine raises here, rather than leaving the broadcast waiting for it.
        ray.get(pending)
        if work is not None:
            work.wait()

    def close(self) -> None:
        if self.broadcast is not None:
            self.broadcast.close()
