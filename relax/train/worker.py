"""One training rank as a Ray actor: torch.distributed from the placement's variables, then a MegatronActor.

The driver (relax.run.loop) sends each rank its data-parallel share of a rollout (the ranks of one data-parallel
replica get the same share) and calls every rank otherwise with the same arguments.

Nothing a rank receives holds a megatron object: Ray unpickles an actor's arguments before its __init__
runs, and the platform must prepare Megatron before megatron's first import (on an NPU, MindSpeed patches
it). The Megatron settings arrive as plain values and become megatron-core config objects here.
"""

import torch

from relax.ray.placement import local_device_index, settled
from relax.train.batch import RolloutBatch


class TrainWorker:
    def __init__(
        self, hf_dir: str, megatron_values, settings, device: str, bucket_bytes: int, megatron_features: dict
    ):
        """megatron_values: relax.args.MegatronValues; settings: relax.train.settings.ActorSettings; megatron_features:
        switches of the platform's Megatron adaptation layer (MindSpeed's feature arguments on NPU)."""
        from relax.platform import get_platform

        self.platform = get_platform(device)
        self.platform.prepare_megatron(megatron_features)
        megatron = megatron_values.build()
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
        self.weight_routes = None  # relax.sync.broadcast.WeightRoutes, made at the first push

    def data_parallel_rank(self) -> int:
        return self.dp_rank

    def train(self, batch: RolloutBatch, step_sizes: list[int], with_reference: bool) -> list[dict[str, float]]:
        """This rank's share of a rollout (relax.train.batch.split_over_data_parallel): old-policy (and reference)
        logprobs for all of it, then one optimizer step per entry of `step_sizes`, on that many consecutive
        samples. Logprobs stay on this rank. Returns each step's metrics (the same on every rank)."""
        if sum(step_sizes) != len(batch):
            raise ValueError(f"step sizes {step_sizes} do not add up to the {len(batch)} samples given")
        # Trained in one optimizer step, the old policy is the current one: train_step takes its own logprobs,
        # detached, instead of a forward pass that would compute the same numbers.
        if len(step_sizes) > 1:
            batch.old_logprobs = self.actor.compute_logprobs(batch)
        if with_reference:
            batch.ref_logprobs = self.actor.compute_logprobs(batch, reference=True)
        metrics, start = [], 0
        for size in step_sizes:
            metrics.append(self.actor.train_step(batch.select(range(start, start + size))))
            start += size
        return metrics

    def sleep(self) -> None:
        self.actor.sleep()

    def wake(self) -> None:
        self.actor.wake()

    def save_checkpoint(self, directory: str, step: int) -> None:
        """The actor's sharded checkpoint (relax.train.checkpoint); collective, the actor must be awake."""
        from relax.train.checkpoint import save_checkpoint

        save_checkpoint(self.actor, directory, step)

    def save_hf(self, directory: str) -> None:
        """The actor's weights as an HF directory (relax.train.checkpoint.save_hf, with --hf-checkpoint's other
        files and untrained tensors); collective, the actor must be awake."""
        from relax.train.checkpoint import save_hf

        save_hf(self.actor.model, self.actor.hf_checkpoint, directory)

    def load_checkpoint(self, directory: str) -> int:
        """Load what save_checkpoint wrote (collective, awake); returns the saved step."""
        from relax.train.checkpoint import load_checkpoint

        return load_checkpoint(self.actor, directory)

    def push_weights(
        self, engines: list, engine_tp_size: int, engine_nodes: list[str], kill_after_first_bucket: int | None = None,
        engines_apart: bool = False,
    ) -> dict:
        """Send the weights under HF names, bucket by bucket, to `engines` (Ray handles of
        relax.rollout.worker.EngineWorker, engine e on the devices of training ranks e*k .. (e+1)*k - 1 with
        k = engine_tp_size; with `engines_apart`, on devices of their own: --no-colocate) on the nodes
        `engine_nodes` (Ray node ids, one per engine). Collective over ranks
        (the export gathers TP/EP shards; every rank of a pipeline stage holds the same buckets). Who sends
        what to which engine is relax.sync.broadcast's plan, made at the first push: the training ranks on an
        engine's devices, or the first rank of each stage by handle or by broadcast, through groups kept until
        close_weight_sync(). Every engine has copied a bucket before the next is packed. The engines refuse an
        update that misses a tensor. Returns the bytes of the buckets this rank sent and, per engine, the route
        it sent them on ("same_node", "same_device" or "broadcast"; None where this rank sends nothing).

        A call to an engine that fails (a dead engine) does not stop the push: every bucket is still exported
        and sent to the other engines, whose updates end complete, and every rank takes part in every
        collective; then the first failure is raised (relax.run.colocation restarts the engine and pushes
        again). `kill_after_first_bucket`: a pid this rank SIGKILLs once its first bucket is sent
        (relax.ray.faults: the tests' fault in the middle of a push)."""
        import os
        import signal

        from relax.train.weight_export import weight_buckets

        if self.weight_routes is None:
            self.weight_routes = self._plan_weight_routes(engines, engine_tp_size, engine_nodes, engines_apart)
        else:  # the first push's engines, or an engine restarted in place of one of them
            self.weight_routes.follow(engines)
        routes = self.weight_routes
        self.actor.free_cached_blocks()
        failures = []  # the engine calls that failed, first first
        if self.rank == 0:
            failures += settled([engine.begin_weight_update.remote() for engine in engines])
        torch.distributed.barrier()
        sent = 0
        for named_tensors in weight_buckets(self.actor.model, self.actor.hf_checkpoint, self.bucket_bytes):
            if routes.sends:
                failures += routes.send(named_tensors)
                sent += sum(tensor.numel() * tensor.element_size() for _, tensor in named_tensors)
            if kill_after_first_bucket is not None:
                os.kill(kill_after_first_bucket, signal.SIGKILL)
                kill_after_first_bucket = None
        torch.distributed.barrier()
        if self.rank == 0:
            failures += settled([engine.end_weight_update.remote() for engine in engines])
        if failures:
            raise failures[0]
        return {"bytes": sent, "routes": list(routes.routes)}

    def _plan_weight_routes(self, engines: list, engine_tp_size: int, engine_nodes: list[str], engines_apart: bool):
        """This rank's relax.sync.broadcast.WeightRoutes, from every rank's pipeline stage and node: broadcasts
        only with `engines_apart`. Collective."""
        import ray
        from megatron.core import parallel_state

        from relax.ray.placement import engine_positions
        from relax.sync.broadcast import WeightRoutes, device_groups, plan_broadcasts, plan_pushes

        world = torch.distributed.get_world_size()
        stages, nodes = [None] * world, [None] * world
        torch.distributed.all_gather_object(stages, parallel_state.get_pipeline_model_parallel_rank())
        torch.distributed.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
        if engines_apart:
            pushes = plan_broadcasts(stages, len(engines))
        else:
            positions = engine_positions(world, engine_tp_size)
            if len(engines) != len(positions) or engine_nodes != [nodes[devices[0]] for devices in positions]:
                raise ValueError(
                    f"push_weights: {len(engines)} engines on nodes {engine_nodes} are not engine e on the devices "
                    f"of training ranks {engine_tp_size}*e .. (relax.ray.placement.engine_positions); training "
                    f"ranks' nodes: {nodes}"
                )
            pushes = plan_pushes(stages, nodes, engine_tp_size, self.platform.handles_cross_devices)
        return WeightRoutes(
            engines, pushes, self.rank, engine_tp_size, self.platform, group_name=f"relax-weights-from-rank{self.rank}",
            groups=device_groups(pushes),
        )

    def close_weight_sync(self) -> None:
        """Destroy this rank's weight-push groups, if it made any (at shutdown)."""
        if self.weight_routes is not None:
            routes, self.weight_routes = self.weight_routes, None
            routes.close()
