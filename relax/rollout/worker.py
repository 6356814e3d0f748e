"""One SGLang engine as a Ray actor, on the bundle relax.ray.placement gave it: relax.rollout.engine.RolloutEngine
itself, its methods called through Ray by the driver and the training ranks.

The engine's first device is the actor's logical device index (RELAX_LOCAL_DEVICE), SGLang's base_gpu_id.
SGLang's scheduler and detokenizer ask the kernel to SIGKILL them when their parent dies (PR_SET_PDEATHSIG,
sglang.srt.utils.kill_itself_when_parent_died), so they end with this actor's process, even a SIGKILLed
one: relax needs no watchdog of its own for them. Their own death is reported by the driver's liveness
watch (relax.ray.watch), which polls the processes watched_child_pids names.

The actor is a threaded one with two concurrency groups: the hand-overs (memory, weights) run one at a time in
Ray's default group, in the order they are called, as before; the rollout's groups (generate_group) and the abort
run in GENERATION, up to MAX_CONCURRENT_GROUPS at once, each waiting in its own thread on the engine's event loop
(RolloutEngine runs it in a thread of its own). Not an async actor: Ray runs an async actor's __init__ on its event
loop thread, where SGLang's Engine would take Ray's running loop as its own, and off the main thread, where no
SIGQUIT handler can be installed (SGLang's children SIGQUIT the process when they fail).
"""

import ray

from relax.ray.placement import local_device_index
from relax.rollout.engine import Completion, RolloutEngine, SamplingConfig

GENERATION = "generation"  # the concurrency group of the rollout's calls
MAX_CONCURRENT_GROUPS = 1024  # generate_group calls an engine actor runs at once (threads; Ray queues the rest)


class EngineWorker(RolloutEngine):
    # ray.remote's options for this class (relax.ray.placement.ActorGroup reads them; subclasses inherit them)
    RAY_OPTIONS = {"concurrency_groups": {GENERATION: MAX_CONCURRENT_GROUPS}}

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

    @ray.method(concurrency_group=GENERATION)
    def generate_group(
        self, prompt: list[int], sampling: SamplingConfig, prefixes: list[list[int]] | None = None
    ) -> list[Completion]:
        """sampling.n completions of one prompt, or the continuations of its responses `prefixes` (partial
        rollout): RolloutEngine.generate, beside the actor's other groups."""
        return self.generate([prompt], sampling, None if prefixes is None else [prefixes])[0]

    @ray.method(concurrency_group=GENERATION)
    def abort_requests(self):
        """RolloutEngine.abort_requests, in the group of the generations it ends."""
        super().abort_requests()
