"""relax's flags as typed, frozen settings, built once at parse time: what the loop and the run state read.

    run        RunSettings: the model, the steps and seed, the devices, the run mode, the checkpoint to resume
    rollout    RolloutSettings: the prompts, the reward function, sampling, the engines, dynamic sampling, replay
    algorithm  AlgorithmSettings: advantages and how a rollout splits into optimizer steps
    evaluation EvalSettings: the held-out prompt sets, when they are evaluated, their sampling
    actor      relax.train.settings.ActorSettings: loss, off-policy correction, micro-batches, LR schedule
    outputs    OutputSettings: the run's record, checkpoints, HF directories, the console

Each builder maps flags (the parsed namespace, its defaults filled in and checked) to one group; this is the only
place a flag's name meets the setting it becomes. A setting's own __post_init__ refusing a value (SamplingConfig's
top_p outside (0, 1], ...) is reported by the parser, naming the value, before anything starts.
"""

import argparse
import dataclasses
import enum

from relax.args.relax_flags import MEGATRON_FEATURE_FLAGS
from relax.hf_checkpoint import HFCheckpoint
from relax.platform import platform_facts
from relax.ray.watch import Timeout
from relax.rollout.custom_generate import SlimeArgs, slime_args
from relax.rollout.data import PromptDataConfig
from relax.rollout.engine import SamplingConfig
from relax.rollout.multi_turn import DEFAULT_MAX_TURNS, ToolRollout
from relax.rollout.rollout import Partial, most_requests_per_engine
from relax.rollout.tools import load_tools, tool_schema
from relax.train.algorithms import ALGORITHMS
from relax.train.losses import LossSettings
from relax.train.off_policy import RolloutCorrection
from relax.train.settings import ActorSettings


class RunMode(enum.Enum):
    """What a run does, resolved once at parse time from --debug-rollout-only, --debug-train-only, --eval-only and
    --load-rollout-data (run_mode); the loop, the checks and the dry-run ask it."""

    # name, then: has_actor (training actors are created and trained), has_engines (SGLang engines are started: for
    # rollouts, evaluations, the trained weights), reads_prompts (rollouts are generated from --prompt-data),
    # replays_rollouts (each step's scored rollout is read from --load-rollout-data), runs_steps (--num-steps steps
    # run; otherwise only the evaluation at step 0)
    TRAIN = ("train", True, True, True, False, True)
    ROLLOUT_ONLY = ("rollout-only", False, True, True, False, True)  # --debug-rollout-only
    EVAL_ONLY = ("eval-only", False, True, False, False, False)  # --eval-only
    REPLAY = ("replay", True, True, False, True, True)  # --load-rollout-data
    TRAIN_ONLY = ("train-only", True, False, False, True, True)  # --debug-train-only --load-rollout-data

    def __init__(self, label, has_actor, has_engines, reads_prompts, replays_rollouts, runs_steps):
        self.label = label
        self.has_actor = has_actor
        self.has_engines = has_engines
        self.reads_prompts = reads_prompts
        self.replays_rollouts = replays_rollouts
        self.runs_steps = runs_steps

    def __repr__(self) -> str:
        facts = ("has_actor", "has_engines", "reads_prompts", "replays_rollouts", "runs_steps")
        return f"RunMode.{self.name}({', '.join(f'{fact}={getattr(self, fact)}' for fact in facts)})"


def run_mode(flags: argparse.Namespace) -> RunMode:
    """The mode the four flags give. Where they contradict each other the parse-time checks refuse them; the order
    here keeps each refusal's message the one about the flag that does not fit (e.g. --eval-prompt-data with
    --debug-train-only: no engines)."""
    if flags.debug_train_only:
        return RunMode.TRAIN_ONLY
    if flags.eval_only:
        return RunMode.EVAL_ONLY
    if flags.load_rollout_data:
        return RunMode.REPLAY
    if flags.debug_rollout_only:
        return RunMode.ROLLOUT_ONLY
    return RunMode.TRAIN


@dataclasses.dataclass(frozen=True)
class RunSettings:
    hf_checkpoint: str | None  # the HF model directory: the engines' weights and the actor's architecture
    device: str  # the platform's name (relax.platform)
    num_steps: int
    seed: int  # data order, sampling seeds, Megatron's init
    num_nodes: int
    num_devices_per_node: int
    colocate: bool  # the actor and the engines time-share the devices
    rollout_num_devices: int | None  # the engines' own devices (--no-colocate; 0: beside the actor); None colocated
    megatron_features: dict  # MindSpeed switches given (name -> True), for every training rank's repatch
    update_weight_buffer_size: int  # bytes per weight-sync bucket
    mode: RunMode
    load: str | None  # a --save directory (or one of its steps) to resume from
    max_restarts: int  # times the run resumes from its newest checkpoint after a worker fails
    dry_run: bool  # validate and print; run nothing
    max_engine_restarts: int  # engines started again in place over the run before a dead engine fails it
    engine_start_timeout: Timeout  # an engine's start, at the run's start or after a restart
    rollout_timeout: Timeout  # one engine's share of one generate call
    weight_sync_timeout: Timeout  # each call of the device hand-over: memory release/resume, wake/sleep, push
    train_timeout: Timeout  # the training ranks' other calls: a step's training, checkpoint save and load


@dataclasses.dataclass(frozen=True)
class ContextLength:
    """The most tokens an engine request may take, prompt and response together (SGLang refuses a request past it):
    the smaller of the language model's max_position_embeddings and --sglang-context-length."""

    tokens: int
    source: str  # where it comes from, in words: "--sglang-context-length" or the config.json field


def context_length(checkpoint: HFCheckpoint | None, sglang_context_length: int | None) -> ContextLength | None:
    """The engines' context length, from --hf-checkpoint's config.json (None: not read, a dry run without it) and
    --sglang-context-length (None: not given); None when neither gives one."""
    found = []
    positions = None if checkpoint is None else checkpoint.text_config.get("max_position_embeddings")
    if positions is not None:
        field = "text_config.max_position_embeddings" if checkpoint.vision_language else "max_position_embeddings"
        found.append(ContextLength(positions, f"{checkpoint.directory / 'config.json'} {field}"))
    if sglang_context_length is not None:
        found.append(ContextLength(sglang_context_length, "--sglang-context-length"))
    return min(found, key=lambda length: length.tokens, default=None)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    data: PromptDataConfig | None  # None: no --prompt-data (only where RunMode.reads_prompts is False)
    shuffle: bool  # the prompts, each epoch, seeded by RunSettings.seed
    reward_fn: str | None  # a built-in name or module:function (relax.rollout.rewards)
    reward_timeout: float | None  # seconds per reward function call; None: unbounded
    sampling: SamplingConfig  # n responses per prompt; the loop sets each step's seed
    batch_size: int  # prompts per step
    devices_per_engine: int  # an SGLang engine's tensor-parallel size
    dynamic_sampling: bool  # keep only groups with unequal rewards, refilling
    over_sampling_batch_size: int | None  # prompts submitted at a time; None where no rollout is generated
    max_prompts: int | None  # prompts a step may submit before the run stops; None where no rollout is generated
    partial: Partial | None  # --partial-rollout: aborted groups keep their tokens (its --max-staleness); else None
    overlong_buffer_len: int | None  # DAPO's overlong shaping: the last this many tokens before the limit
    overlong_penalty_factor: float | None  # the penalty at the limit
    load_data: str | None  # the scored samples replayed (RunMode.replays_rollouts), a pattern of step files
    save_data: str | None  # write each step's scored samples to this pattern
    routing_replay: bool  # samples carry the experts the engine chose (saved and loaded with them) for the actor
    context: ContextLength | None  # the engines' context length; None: unknown (a dry run without the checkpoint)
    tools: ToolRollout | None = None  # --tools: multi-turn samples with tool calls; None: one turn per sample
    # --custom-generate-function-path: the function and its `args`, for the engine actors; None: relax's own request
    custom_generate: SlimeArgs | None = None

    @property
    def max_response_len(self) -> int:
        return self.sampling.max_new_tokens


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    datasets: dict[str, PromptDataConfig]  # name -> its prompts, as --eval-prompt-data pairs them; empty: no evaluation
    interval: int | None  # every this many steps, besides before the first and after the last; None: only then
    sampling: SamplingConfig  # n responses per prompt; each set's seed is set per set (relax.rollout.evaluation)


@dataclasses.dataclass(frozen=True)
class AlgorithmSettings:
    advantage_estimator: str  # a name in relax.train.algorithms.ALGORITHMS
    normalize_advantages_by_std: bool
    group_size: int  # responses per prompt: the group advantages are normalised over (more in a group a custom
    # generate function fanned out: relax.rollout.groups.group_sizes)
    global_batch_size: int  # samples per optimizer step (more with fan-out: relax.train.batch.optimizer_step_sizes)
    uses_reference: bool  # a KL-to-reference term is in the loss: reference logprobs are computed


@dataclasses.dataclass(frozen=True)
class OutputSettings:
    output_dir: str  # metrics.jsonl, TensorBoard events, the reward curve
    wandb_project: str | None  # None: no Weights & Biases
    save: str | None  # checkpoints (relax.run.state)
    save_interval: int | None  # every this many steps (and after the last)
    save_hf: str | None  # at every save, the actor's weights as an HF directory too
    overwrite_output_dir: bool = False  # a new run replaces an earlier run's record there (relax.run.inputs)
    verbose: bool = False  # every line on the console, not only relax's and upstream errors (relax.console)
    engine_logs: bool = False  # SGLang logs at info level and the engines' lines are shown on the console


def run_settings(flags: argparse.Namespace) -> RunSettings:
    return RunSettings(
        hf_checkpoint=flags.hf_checkpoint,
        device=flags.device,
        num_steps=flags.num_steps,
        seed=flags.seed,
        num_nodes=flags.num_nodes,
        num_devices_per_node=flags.num_devices_per_node,
        colocate=flags.colocate,
        rollout_num_devices=None if flags.colocate else flags.rollout_num_devices,
        megatron_features={name: True for name in MEGATRON_FEATURE_FLAGS if getattr(flags, name)},
        update_weight_buffer_size=flags.update_weight_buffer_size,
        mode=run_mode(flags),
        load=flags.load,
        max_restarts=flags.max_restarts or 0,
        dry_run=flags.dry_run,
        max_engine_restarts=flags.max_engine_restarts,
        engine_start_timeout=Timeout(flags.engine_start_timeout, "--engine-start-timeout"),
        rollout_timeout=Timeout(flags.rollout_timeout, "--rollout-timeout"),
        weight_sync_timeout=Timeout(flags.weight_sync_timeout, "--weight-sync-timeout"),
        train_timeout=Timeout(flags.train_timeout, "--train-timeout"),
    )


def prompt_data_config(flags: argparse.Namespace, path: str | None) -> PromptDataConfig | None:
    """The prompts at `path` (--prompt-data, or an --eval-prompt-data set), read as the data flags say."""
    if path is None:
        return None
    return PromptDataConfig(
        path=path,
        prompt_key=flags.input_key,
        label_key=flags.label_key,
        metadata_key=flags.metadata_key,
        apply_chat_template=flags.apply_chat_template,
        chat_template_kwargs=flags.apply_chat_template_kwargs or {},
        system_prompt=flags.system_prompt,
        max_prompt_tokens=flags.max_prompt_length,
        skip_bad_rows=flags.skip_bad_rows,
        tools=tuple(tool_schema(tool) for tool in load_tools(flags.tools or [], "--tools").values()),
    )


def rollout_settings(flags: argparse.Namespace, context: ContextLength | None) -> RolloutSettings:
    """`context`: the engines' context length (context_length)."""
    clip = flags.rollout_clip_response_to_context and context is not None
    return RolloutSettings(
        data=prompt_data_config(flags, flags.prompt_data),
        shuffle=flags.rollout_shuffle,
        reward_fn=flags.reward_fn,
        reward_timeout=flags.reward_timeout,
        sampling=SamplingConfig(
            n=flags.n_samples_per_prompt,
            temperature=flags.rollout_temperature,
            top_p=flags.rollout_top_p,
            top_k=flags.rollout_top_k,
            max_new_tokens=flags.rollout_max_response_len,
            stop_token_ids=tuple(flags.rollout_stop_token_ids or ()),
            clip_to_context=context.tokens if clip else None,
        ),
        batch_size=flags.rollout_batch_size,
        devices_per_engine=flags.rollout_num_devices_per_engine,
        dynamic_sampling=flags.dynamic_sampling,
        over_sampling_batch_size=flags.over_sampling_batch_size,
        max_prompts=flags.rollout_max_prompts,
        partial=Partial(flags.max_staleness) if flags.partial_rollout else None,
        overlong_buffer_len=flags.overlong_buffer_len,
        overlong_penalty_factor=flags.overlong_penalty_factor,
        load_data=flags.load_rollout_data,
        save_data=flags.save_rollout_data,
        routing_replay=flags.use_rollout_routing_replay,
        context=context,
        tools=tool_rollout(flags),
        custom_generate=(
            None if flags.custom_generate_function_path is None
            else slime_args(flags.custom_generate_function_path, flags, rollout_requests_per_engine(flags))
        ),
    )


def tool_rollout(flags: argparse.Namespace) -> ToolRollout | None:
    """--tools and --max-turns, for the engine actors (the chat template's options too, as the prompts use them)."""
    if not flags.tools:
        return None
    return ToolRollout(tuple(flags.tools), flags.max_turns or DEFAULT_MAX_TURNS, flags.apply_chat_template_kwargs or {})


def eval_settings(flags: argparse.Namespace, rollout_sampling: SamplingConfig) -> EvalSettings:
    """The eval samples as the rollout does (`rollout_sampling`: top-k, stop tokens) but for what the eval flags
    set. (relax.args filled those with the rollout's when --eval-prompt-data is given, and the checks refused an
    odd number of its values.)"""
    pairs = flags.eval_prompt_data or []
    if not pairs:
        return EvalSettings(datasets={}, interval=None, sampling=SamplingConfig())
    return EvalSettings(
        datasets={name: prompt_data_config(flags, path) for name, path in zip(pairs[::2], pairs[1::2])},
        interval=flags.eval_interval,
        sampling=dataclasses.replace(
            rollout_sampling,
            n=flags.eval_n_samples_per_prompt,
            temperature=flags.eval_temperature,
            top_p=flags.eval_top_p,
            max_new_tokens=flags.eval_max_response_len,
        ),
    )


def engine_devices(flags: argparse.Namespace) -> int:
    """The devices the engines run on: the actor's when colocated or beside it (--rollout-num-devices 0), else
    --rollout-num-devices (0 while not given: the checks refuse that)."""
    if flags.colocate or flags.rollout_num_devices == 0:
        return flags.num_nodes * flags.num_devices_per_node
    return flags.rollout_num_devices or 0


def rollout_requests_per_engine(flags: argparse.Namespace) -> int:
    """The most requests one engine runs at once in a rollout: the groups in flight (--over-sampling-batch-size,
    else --rollout-batch-size) balanced over the engines, x --n-samples-per-prompt. (Devices that no whole engine
    fits are refused by the checks, after this is read.)"""
    prompts = flags.over_sampling_batch_size or flags.rollout_batch_size
    num_engines = max(1, engine_devices(flags) // flags.rollout_num_devices_per_engine)
    return most_requests_per_engine(prompts, flags.n_samples_per_prompt, num_engines)


def uses_reference(flags: argparse.Namespace) -> bool:
    return flags.use_kl_loss and flags.kl_coef != 0.0


def algorithm_settings(flags: argparse.Namespace) -> AlgorithmSettings:
    return AlgorithmSettings(
        advantage_estimator=flags.advantage_estimator,
        normalize_advantages_by_std=flags.normalize_advantages_by_std,
        group_size=flags.n_samples_per_prompt,
        global_batch_size=flags.global_batch_size,
        uses_reference=uses_reference(flags),
    )


def actor_settings(flags: argparse.Namespace, scheduler: argparse.Namespace) -> ActorSettings:
    """`scheduler`: the LR schedule's flags (MegatronConfig.scheduler)."""
    kl = (
        dict(kl_coef=flags.kl_coef, kl_estimator=flags.kl_loss_type, k3_clamp=flags.k3_clamp)
        if uses_reference(flags)
        else {}
    )
    algorithm = ALGORITHMS[flags.advantage_estimator]
    loss = LossSettings(
        loss_mode=algorithm.loss_mode,
        clip_low=flags.eps_clip,
        clip_high=flags.eps_clip_high,
        dual_clip=flags.eps_clip_c,
        log_ratio_clamp=flags.log_ratio_clamp,
        ratio_level=algorithm.ratio_level,
        aggregation=flags.loss_aggregation.replace("-", "_"),
        # Dr. GRPO's constant: the longest response the engine may give, the same on every rank and step
        norm_length=flags.rollout_max_response_len,
        entropy_coef=flags.entropy_coef,
        **kl,
    )
    tis = dict(tis_clip=flags.tis_clip, tis_clip_low=flags.tis_clip_low) if flags.use_tis else {}
    correction = RolloutCorrection(
        mis_bounds=flags.rollout_rs_threshold if flags.rollout_rs == "seq_mean_k1" else None,
        use_rollout_logprobs=flags.use_rollout_logprobs,
        **tis,
    )
    decay_steps = scheduler.lr_decay_iters or flags.num_steps
    # Megatron-LM's rule: a warmup fraction is of the decay steps, else --lr-warmup-iters (both: refused)
    warmup_steps = (
        scheduler.lr_warmup_iters
        if scheduler.lr_warmup_fraction is None
        else round(scheduler.lr_warmup_fraction * decay_steps)
    )
    return ActorSettings(
        loss=loss,
        rollout_correction=correction,
        micro_batch_size=flags.micro_batch_size,
        max_tokens_per_micro_batch=flags.max_tokens_per_device if flags.use_dynamic_batch_size else None,
        max_tokens_per_forward=flags.log_probs_max_tokens_per_device,
        gdn_training_kernel=flags.gdn_training_kernel,
        temperature=flags.rollout_temperature or 1.0,
        fused_output_logprobs=flags.fused_output_logprobs,
        seed=flags.seed,
        keep_reference=uses_reference(flags),
        memory_saver=flags.colocate and actor_sleep_route(flags) == "memory-saver",
        lr_warmup_steps=warmup_steps,
        lr_warmup_init=scheduler.lr_warmup_init,
        lr_decay_steps=decay_steps,
        lr_decay_style=scheduler.lr_decay_style,
    )


def output_settings(flags: argparse.Namespace) -> OutputSettings:
    return OutputSettings(
        output_dir=flags.output_dir,
        wandb_project=flags.wandb_project if flags.use_wandb else None,
        save=flags.save,
        save_interval=flags.save_interval,
        save_hf=flags.save_hf,
        overwrite_output_dir=flags.overwrite_output_dir,
        verbose=flags.verbose,
        engine_logs=flags.engine_logs,
    )


def actor_sleep_route(flags) -> str:
    """--actor-sleep-route, with auto resolved to the platform's route."""
    if flags.actor_sleep_route == "auto":
        return platform_facts(flags.device).actor_sleep_route
    return flags.actor_sleep_route
