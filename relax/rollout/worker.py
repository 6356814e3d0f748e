"""One SGLang engine as a Ray actor, on the bundle relax.ray.placement gave it.

The engine's first device is the actor's logical device index (RELAX_LOCAL_DEVICE), SGLang's base_gpu_id.
The methods are the engine wrapper's, so the driver and the training ranks call them through Ray.
SGLang's scheduler and detokenizer ask the kernel to SIGKILL them when their parent dies (PR_SET_PDEATHSIG,
sglang.srt.utils.kill_itself_when_parent_died), so they end with this actor's process, even a SIGKILLed
one: relax needs no watchdog of its own for them. Their own death is reported by the driver's liveness
watch (relax.ray.watch), which polls the processes watched_child_pids names.
"""

from relax.ray.placement import local_device_index
from relax.rollout.engine import RolloutEngine


class EngineWorker:
    def __init__(self, server_args, model_path: str, device: str, tp_size: int, enable_memory_saver: bool):
        from relax.platform import get_platform

        self.engine = RolloutEngine(
            server_args,
            model_path=model_path,
            platform=get_platform(device),
            tp_size=tp_size,
            base_gpu_id=local_device_index(),
            enable_memory_saver=enable_memory_saver,
        )

    def watched_child_pids(self) -> list[int]:
        """The engine's scheduler and detokenizer processes, for the driver's liveness watch
        (relax.ray.watch): a SIGKILLed scheduler ends nothing else, and the engine would notice only at
        its next call."""
        return self.engine.child_pids

    def generate(self, prompts: list[list[int]], sampling):
        return self.engine.generate(prompts, sampling)

    def release_memory_occupation(self, tags):
        self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags):
        self.engine.resume_memory_occupation(tags)

    def begin_weight_update(self):
        self.engine.begin_weight_update()

    def update_weights_from_serialized_bucket(self, specs, payloads):
        self.engine.update_weights_from_serialized_bucket(specs, payloads)

    def end_weight_update(self):
        self.engine.end_weight_update()

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name, backend):
        self.engine.init_weights_update_group(master_address, master_port, rank_offset, world_size, group_name, backend)

    def update_weights_from_distributed(self, specs, dtypes, group_name):
        self.engine.update_weights_from_distributed(specs, dtypes, group_name)

    def destroy_weights_update_group(self, group_name):
        self.engine.destroy_weights_update_group(group_name)

    def shutdown(self):
        self.engine.shutdown()
