"""What the training actor needs beyond megatron-core's config objects, importable without Megatron (relax.args
builds it at parse time; the training workers receive it)."""

import dataclasses

from relax.train.losses import LossSettings
from relax.train.off_policy import RolloutCorrection


@dataclasses.dataclass(frozen=True)
class ActorSettings:
    """What the actor needs beyond megatron-core's config objects."""

    loss: LossSettings = dataclasses.field(default_factory=LossSettings)
    # TIS / MIS / rollout logprobs as the old policy (relax.train.off_policy); needs the batch's rollout_logprobs
    rollout_correction: RolloutCorrection = dataclasses.field(default_factory=RolloutCorrection)
    micro_batch_size: int = 1  # samples per micro-batch without a token budget
    max_tokens_per_micro_batch: int | None = None  # dynamic batch size: pack samples up to this many tokens
    # The token budget of forward-only passes (old-policy and reference logprobs), which keep no activations for
    # backward and so fit more tokens; None: the training budget.
    max_tokens_per_forward: int | None = None
    gdn_training_kernel: str = "reference"  # GDN layers' chunked rule (relax.kernels.gdn_training)
    temperature: float = 1.0  # logits are divided by it, as the rollout engine sampled
    # The output layer's projection fused with the logprob and entropy, pieces of positions at a time: the [tokens,
    # vocab / TP] logits are never held (relax.train.logprobs.output_logprobs_and_entropy)
    fused_output_logprobs: bool = False
    seed: int = 1234
    keep_reference: bool = True  # keep a host copy of the initial weights for reference logprobs
    # Sleep through the platform's memory saver where it has one (relax.train.offload), else host copies.
    # Off where the workers run without one (not colocated: e.g. expandable segments on an NPU).
    memory_saver: bool = True
    # OptimizerParamScheduler; lr, min_lr and weight decay come from the OptimizerConfig
    lr_warmup_steps: int = 0
    lr_warmup_init: float = 0.0  # the lr the warmup starts from
    lr_decay_steps: int = 1  # steps over which lr goes from lr to min_lr ("constant" ignores it)
    lr_decay_style: str = "constant"  # constant | linear | cosine | inverse-square-root | WSD
    distributed_timeout_minutes: int = 30  # of the actor's process groups (megatron's default)
