"""One SGLang engine as a Ray actor, on the bundle relax.ray.placement gave it: relax.rollout.engine.RolloutEngine
itself, its methods called through Ray by the driver and the training ranks.

The engine's first device is the actor's logical device index (RELAX_LOCAL_DEVICE), SGLang's base_gpu_id.
SGLang's scheduler and detokenizer ask the kernel to SIGKILL them when their parent dies (PR_SET_PDEATHSIG,
sglang.srt.utils.kill_itself_when_parent_died), so they end with this actor's process, even a SIGKILLed
one: relax needs no watchdog of its own for them. Their own death is reported by the driver's liveness
watch (relax.ray.watch), which polls the processes watched_child_pids names.
"""

from relax.ray.placement import local_device_index
from relax.rollout.engine import RolloutEngine


class EngineWorker(RolloutEngine):
    def __init__(self, server_args, model_path: str, device: str, tp_size: int, enable_memory_saver: bool):
        from relax.platform import get_platform

        super().__init__(
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
        return self.child_pids
