"""One training rank as a Ray actor: torch.distributed from the placement's variables, then a MegatronActor.

The driver (relax.loop) calls every rank with the same arguments; each rank keeps its own data-parallel
share of the samples, so the driver never needs to know the parallel layout.
"""

import torch

from relax.ray.placement import local_device_index
from relax.train.batch import RolloutBatch


class TrainWorker:
    def __init__(self, hf_dir: str, megatron, settings, device: str, bucket_bytes: int):
        from relax.platform import get_platform

        self.platform = get_platform(device)
        self.platform.prepare_megatron()
        self.platform.set_device(local_device_index())
        # MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE come from relax.ray.placement.
        torch.distributed.init_process_group(backend=self.platform.dist_backend)
        self.rank = torch.distributed.get_rank()

        from megatron.core import parallel_state

        from relax.train.actor import MegatronActor

        self.actor = MegatronActor(
            hf_dir, megatron.transformer, megatron.optimizer, megatron.ddp, settings, platform=self.platform
        )
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.bucket_bytes = bucket_bytes
        self.weight_routes = None  # relax.sync.broadcast.WeightRoutes, made at this sending rank's first push

    def _shard(self, batch: RolloutBatch) -> RolloutBatch:
        """This rank's data-parallel share: every dp_size-th sample."""
        if len(batch) % self.dp_size:
            raise ValueError(f"{len(batch)} samples cannot be split evenly over {self.dp_size} data-parallel ranks")
        pick = slice(self.dp_rank, None, self.dp_size)
        optional = {
            name: getattr(batch, name)[pick]
            for name in ("advantages", "old_logprobs", "ref_logprobs", "rollout_logprobs")
            if getattr(batch, name) is not None
        }
        return RolloutBatch(tokens=batch.tokens[pick], response_lengths=batch.response_lengths[pick], **optional)

    def train(self, batch: RolloutBatch, global_batch_size: int, with_reference: bool) -> list[dict[str, float]]:
        """Old-policy (and reference) logprobs for the whole rollout, then one optimizer step per
        `global_batch_size` samples. Returns each step's metrics (the same on every rank)."""
        if len(batch) % global_batch_size:
            raise ValueError(f"{len(batch)} rollout samples are not a multiple of the global batch size {global_batch_size}")
        batch.old_logprobs = self._gather_shards(batch, reference=False)
        if with_reference:
            batch.ref_logprobs = self._gather_shards(batch, reference=True)
        metrics = []
        for start in range(0, len(batch), global_batch_size):
            step = slice(start, start + global_batch_size)
            step_batch = RolloutBatch(
                tokens=batch.tokens[step],
                response_lengths=batch.response_lengths[step],
                advantages=batch.advantages[step],
                old_logprobs=batch.old_logprobs[step],
                ref_logprobs=batch.ref_logprobs[step] if with_reference else None,
                rollout_logprobs=batch.rollout_logprobs[step] if batch.rollout_logprobs else None,
            )
            metrics.append(self.actor.train_step(self._shard(step_batch)))
        return metrics

    def _gather_shards(self, batch: RolloutBatch, reference: bool) -> list[torch.Tensor]:
        """Logprobs of every sample of the batch: each DP rank computes its share, then all share."""
        from megatron.core import parallel_state

        mine = self.actor.compute_logprobs(self._shard(batch), reference=reference)
        shares = [None] * self.dp_size
        torch.distributed.all_gather_object(shares, mine, group=parallel_state.get_data_parallel_group())
        result = [None] * len(batch)
        for dp_rank, share in enumerate(shares):
            result[dp_rank :: self.dp_size] = share
        return result

    def sleep(self) -> None:
        self.actor.sleep()

    def wake(self) -> None:
        self.actor.wake()

    def save_checkpoint(self, directory: str, step: int) -> None:
        """The actor's sharded checkpoint (relax.train.checkpoint); collective, the actor must be awake."""
        from relax.train.checkpoint import save_checkpoint

        save_checkpoint(self.actor, directory, step)

    def load_checkpoint(self, directory: str) -> int:
        """Load what save_checkpoint wrote (collective, awake); returns the saved step."""
        from relax.train.checkpoint import load_checkpoint

        return load_checkpoint(self.actor, directory)

    def push_weights(self, engines: list, engine_tp_size: int, engine_nodes: list[str]) -> dict:
        """Send the weights under HF names, bucket by bucket, to `engines` (Ray handles of
        relax.rollout.worker.EngineWorker) on the nodes `engine_nodes` (Ray node ids, one per engine).
        Collective over ranks (the export gathers TP/EP shards); the first data- and tensor-parallel rank of
        each pipeline stage sends its stage's layers (relax.sync.broadcast): to engines on its own node as
        payloads (IPC handles on a device, only the handles cross Ray; the bytes on CPU), to engines on other
        nodes by broadcast through a process group it makes at its first push and keeps until
        close_weight_sync(). Every engine has copied a bucket before the next is packed. The engines refuse
        an update that misses a tensor. Returns the bytes this rank sent to each engine and, per engine, the
        route it took from this rank ("same_node" or "broadcast"; None where this rank sends nothing)."""
        import ray
        from megatron.core import parallel_state

        from relax.sync.broadcast import WeightRoutes
        from relax.sync.export import weight_buckets

        routes = None
        if self.dp_rank == 0 and parallel_state.get_tensor_model_parallel_rank() == 0:
            if self.weight_routes is None:
                self.weight_routes = WeightRoutes(
                    engines, engine_nodes, ray.get_runtime_context().get_node_id(), engine_tp_size, self.platform,
                    group_name=f"relax-weights-from-rank{self.rank}",
                )
            elif not self.weight_routes.serves(engines):
                raise ValueError("push_weights: the engines differ from the first push's; call close_weight_sync() first")
            routes = self.weight_routes
        if self.rank == 0:
            ray.get([engine.begin_weight_update.remote() for engine in engines])
        torch.distributed.barrier()
        sent = 0
        for named_tensors in weight_buckets(self.actor.model, self.actor.hf, self.bucket_bytes):
            if routes is not None:
                routes.send(named_tensors)
                sent += sum(tensor.numel() * tensor.element_size() for _, tensor in named_tensors)
        torch.distributed.barrier()
        if self.rank == 0:
            ray.get([engine.end_weight_update.remote() for engine in engines])
        return {"bytes": sent, "routes": list(routes.routes) if routes is not None else [None] * len(engines)}

    def close_weight_sync(self) -> None:
        """Destroy this rank's broadcast group to the engines on other nodes, if it made one (at shutdown)."""
        if self.weight_routes is not None:
            routes, self.weight_routes = self.weight_routes, None
            routes.close()
