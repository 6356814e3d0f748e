"""Rules that involve more than one flag. Each returns the problem in words naming the flags, or None.

Each rule takes the parsed configuration (Parsed: relax's flags, the Megatron config objects, the engines'
ServerArgs, the run mode) and the relax.platform record of the run's device. They run before the settings are built
(relax.args.settings).
"""

import argparse
import importlib.util
import re
import typing
from pathlib import Path

from relax.args.memory import actor_memory, memory_for_training
from relax.args.relax_flags import MEGATRON_FEATURE_FLAGS
from relax.args.settings import RunMode, run_mode
from relax.kernels.gdn_training import KERNEL_PACKAGES
from relax.args.unsupported import unsupported_combinations
from relax.rollout.dump import pattern_problem
from relax.rollout.engine import PRIORITY_SCHEDULE_POLICIES
from relax.rollout.custom_generate import load_custom_generate_fn
from relax.rollout.rollout import rollout_seeds_problem
from relax.rollout.tools import load_tools
from relax.train.memory_estimate import GIB
from relax.train.algorithms import ALGORITHMS, STD_NORMALISED


class Parsed(typing.NamedTuple):
    flags: argparse.Namespace  # relax's flags, defaults filled in
    megatron: typing.Any  # relax.args.megatron.MegatronConfig
    sglang: typing.Any  # the engines' sglang.srt.server_args.ServerArgs (relax.args.sglang.build_server_args)

    @property
    def mode(self) -> RunMode:
        return run_mode(self.flags)


def scores_samples(config: Parsed) -> bool:
    """--reward-fn scores what the engines generate: the rollouts, or an evaluation (--eval-prompt-data), which
    --debug-train-only starts no engines for."""
    return config.mode.reads_prompts or (config.flags.eval_prompt_data is not None and config.mode.has_engines)


def world_size(flags) -> int:
    return flags.num_nodes * flags.num_devices_per_node


def engines_on_actor_devices(flags) -> bool:
    """Whether the engines run on the actor's devices: colocated, or beside it (--no-colocate --rollout-num-devices
    0)."""
    return flags.colocate or flags.rollout_num_devices == 0


def data_parallel_size(config) -> int:
    tc = config.megatron.transformer
    return world_size(config.flags) // (
        tc.tensor_model_parallel_size * tc.pipeline_model_parallel_size * tc.context_parallel_size
    )


def required_flags(config, platform):
    r = config.flags
    needed = []
    if r.hf_checkpoint is None and not r.dry_run:
        needed.append("--hf-checkpoint (only --dry-run may leave it out)")
    if config.mode.reads_prompts and r.prompt_data is None:
        needed.append("--prompt-data")
    if scores_samples(config) and r.reward_fn is None:
        needed.append("--reward-fn")
    if config.mode.has_actor and config.megatron.optimizer.lr is None:
        needed.append("--lr")
    return f"missing {', '.join(needed)}" if needed else None


def model_parallel_fits_devices(config, platform):
    tc, r = config.megatron.transformer, config.flags
    product = tc.tensor_model_parallel_size * tc.pipeline_model_parallel_size * tc.context_parallel_size
    if world_size(r) % product:
        return (
            f"--tensor-model-parallel-size {tc.tensor_model_parallel_size} x --pipeline-model-parallel-size "
            f"{tc.pipeline_model_parallel_size} x --context-parallel-size {tc.context_parallel_size} = {product} "
            f"does not divide the {world_size(r)} devices "
            f"(--num-nodes {r.num_nodes} x --num-devices-per-node {r.num_devices_per_node})"
        )


def expert_parallel_fits(config, platform):
    tc, r = config.megatron.transformer, config.flags
    ep = tc.expert_model_parallel_size
    etp = tc.expert_tensor_parallel_size or tc.tensor_model_parallel_size
    if ep == 1:
        return None  # (EP > 1 without experts: megatron-core's TransformerConfig refuses it already)
    if tc.num_moe_experts % ep:
        return f"--expert-model-parallel-size {ep} does not divide the {tc.num_moe_experts} experts (--num-experts)"
    product = ep * etp * tc.pipeline_model_parallel_size
    if world_size(r) % product:
        return (
            f"--expert-model-parallel-size {ep} x expert tensor parallel {etp} x --pipeline-model-parallel-size "
            f"{tc.pipeline_model_parallel_size} = {product} does not divide the {world_size(r)} devices"
        )


def vocabulary_splits_over_tensor_parallel(config, platform):
    vocab, tp = config.megatron.model.vocab_size, config.megatron.transformer.tensor_model_parallel_size
    if vocab is not None and vocab % tp:
        return (
            f"the vocabulary of {vocab} tokens (config.json's vocab_size or --vocab-size) does not divide over "
            f"--tensor-model-parallel-size {tp}: relax keeps the HF vocabulary unpadded (engines get HF-shaped "
            "weights); choose a tensor-parallel size that divides it"
        )


def rollout_fills_global_batches(config, platform):
    r = config.flags
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    if samples % r.global_batch_size:
        return (
            f"--rollout-batch-size {r.rollout_batch_size} x --n-samples-per-prompt {r.n_samples_per_prompt} "
            f"= {samples} "
            f"samples is not a multiple of --global-batch-size {r.global_batch_size}"
        )


def global_batch_splits_over_data_parallel(config, platform):
    r = config.flags
    dp = data_parallel_size(config)
    if dp == 0:
        return None  # model_parallel_fits_devices reports it
    per_step = dp if r.use_dynamic_batch_size else r.micro_batch_size * dp
    if r.global_batch_size % per_step:
        what = (
            f"data-parallel size {dp}"
            if r.use_dynamic_batch_size
            else f"--micro-batch-size {r.micro_batch_size} x data-parallel size {dp}"
        )
        return f"--global-batch-size {r.global_batch_size} is not a multiple of {what} = {per_step}"


def engine_fits_devices(config, platform):
    r = config.flags
    if engines_on_actor_devices(r) and world_size(r) % r.rollout_num_devices_per_engine:
        return (
            f"--rollout-num-devices-per-engine {r.rollout_num_devices_per_engine} "
            f"does not divide the {world_size(r)} devices "
            f"(--num-nodes {r.num_nodes} x --num-devices-per-node {r.num_devices_per_node})"
        )


def engines_within_pipeline_stages(config, platform):
    """Where handles do not cross devices, weights reach an engine rank from the training rank on its device or by
    broadcast, never from a rank on one of its devices by broadcast (relax.sync.broadcast.plan_pushes)."""
    r, pp = config.flags, config.megatron.transformer.pipeline_model_parallel_size
    # apart, every engine gets broadcasts
    if platform.handles_cross_devices or world_size(r) % pp or not engines_on_actor_devices(r):
        return None
    # (no weights are pushed without an actor or engines; --eval-only checks the training flags as for a run)
    if config.mode in (RunMode.ROLLOUT_ONLY, RunMode.TRAIN_ONLY):
        return None
    per_stage = world_size(r) // pp
    if per_stage % r.rollout_num_devices_per_engine:
        return (
            f"--rollout-num-devices-per-engine {r.rollout_num_devices_per_engine} does not divide the {per_stage} "
            f"devices of each pipeline stage ({world_size(r)} devices / --pipeline-model-parallel-size {pp}): on "
            f"{platform.name!r} an engine takes its weights from the training ranks on its own devices, so its "
            "devices must lie within one stage's; choose an engine size that divides them"
        )


def colocation_releases_memory(config, platform):
    if config.flags.colocate and platform.colocation_needs_release and not platform.has_memory_saver:
        return (
            f"--colocate on {platform.name} needs the rollout engine to release its memory (SGLang's memory saver), "
            "which this platform's record (relax.platform) names none of; run on a platform that has one, or give "
            "the engines devices of their own (--no-colocate --rollout-num-devices N)"
        )


# What a separate-devices run (--no-colocate, relax.run.loop_async) cannot carry out, with the fix.
SEPARATE_DEVICES_REFUSED = {
    RunMode.ROLLOUT_ONLY: "--debug-rollout-only starts no actor to run beside the engines; drop --no-colocate",
    RunMode.TRAIN_ONLY: "--debug-train-only starts no engines to run beside the actor; drop --no-colocate",
    RunMode.EVAL_ONLY: "--eval-only trains nothing to overlap with; drop --no-colocate",
    RunMode.REPLAY: (
        "--load-rollout-data replays saved rollouts, so there is no generation to overlap with training; drop "
        "--no-colocate"
    ),
}


def engines_have_their_own_devices(config, platform):
    """--rollout-num-devices places the engines apart from the actor (--no-colocate) and is read only there; apart,
    the engines must fill their devices, and the colocated-only settings are refused."""
    r = config.flags
    if r.colocate:
        if r.rollout_num_devices is not None:
            return (
                "--rollout-num-devices (--rollout-num-gpus) is read only with --no-colocate: colocated, the engines "
                "run on the actor's --num-nodes x --num-devices-per-node devices; drop it, or add --no-colocate"
            )
        return None
    problems = []
    if config.mode in SEPARATE_DEVICES_REFUSED:
        problems.append(f"--no-colocate with {SEPARATE_DEVICES_REFUSED[config.mode]}")
    if r.rollout_num_devices is None:
        problems.append(
            "--no-colocate needs --rollout-num-devices N (--rollout-num-gpus): the engines' own devices, or 0 for "
            "the engines beside the actor on its devices"
        )
    elif r.rollout_num_devices % r.rollout_num_devices_per_engine:
        problems.append(
            f"--rollout-num-devices-per-engine {r.rollout_num_devices_per_engine} does not divide the "
            f"--rollout-num-devices {r.rollout_num_devices} devices of the engines; give a multiple of it"
        )
    if r.actor_sleep_route != "auto":
        problems.append(
            f"--actor-sleep-route {r.actor_sleep_route} with --no-colocate: the actor never sleeps on devices of its "
            "own; drop it"
        )
    return "\n".join(problems) or None


def lr_warmup_given_once(config, platform):
    scheduler = config.megatron.scheduler
    if scheduler.lr_warmup_fraction is None:
        return None
    if scheduler.lr_warmup_iters:
        return (
            f"--lr-warmup-fraction {scheduler.lr_warmup_fraction} and --lr-warmup-iters {scheduler.lr_warmup_iters} "
            "both set the warmup's length: give one"
        )
    if not 0 <= scheduler.lr_warmup_fraction <= 1:
        return f"--lr-warmup-fraction {scheduler.lr_warmup_fraction} must be within [0, 1] (of --lr-decay-iters)"


def clip_range_ordered(config, platform):
    r = config.flags
    if r.eps_clip_high < r.eps_clip:
        return f"--eps-clip-high {r.eps_clip_high} is below --eps-clip {r.eps_clip}"


def dual_clip_applies(config, platform):
    r = config.flags
    if r.eps_clip_c is None:
        return None
    if not ALGORITHMS[r.advantage_estimator].dual_clip:
        return (
            f"--eps-clip-c bounds PPO's clipped loss; {r.advantage_estimator}'s loss weighs each token by its capped "
            "ratio instead (--eps-clip, --eps-clip-high): drop --eps-clip-c"
        )
    if r.eps_clip_c <= 1:
        return f"--eps-clip-c {r.eps_clip_c} must be > 1 (it bounds the loss of ratios past 1 + --eps-clip-high)"


def kl_loss_has_weight(config, platform):
    if config.flags.use_kl_loss and config.flags.kl_coef <= 0:
        return "--use-kl-loss with --kl-coef 0 adds nothing: give --kl-coef > 0 or drop --use-kl-loss"


def kl_flags_need_kl_loss(config, platform):
    r = config.flags
    if r.kl_coef != 0 and not r.use_kl_loss:
        return (
            f"--kl-coef {r.kl_coef} without --use-kl-loss would do nothing: relax puts the KL-to-reference penalty "
            "in the loss only (no penalty on the reward); add --use-kl-loss or drop --kl-coef"
        )
    if r.kl_loss_type is not None and not r.use_kl_loss:
        return "--kl-loss-type only applies with --use-kl-loss"
    if r.k3_clamp is not None and r.kl_loss_type != "k3":
        return "--k3-clamp only applies with --use-kl-loss and the k3 estimator (--kl-loss-type k3, the default)"


def std_normalisation_applies(config, platform):
    r = config.flags
    if not r.normalize_advantages_by_std and not ALGORITHMS[r.advantage_estimator].divides_by_group_std:
        return (
            f"--no-normalize-advantages-by-std changes nothing with --advantage-estimator {r.advantage_estimator}, "
            f"which never divides by the group's std (only {', '.join(STD_NORMALISED)} do); drop it"
        )


def groups_fit_the_estimator(config, platform):
    r = config.flags
    if r.n_samples_per_prompt > 1:
        return None
    algorithm = ALGORITHMS[r.advantage_estimator]
    if algorithm.divides_by_group_std and r.normalize_advantages_by_std:
        return (
            f"--advantage-estimator {algorithm.name} divides by the std of each prompt's responses, which "
            "one response (--n-samples-per-prompt 1) does not have: give --n-samples-per-prompt 2 or more, or "
            "--no-normalize-advantages-by-std"
        )
    if algorithm.needs_group_because:
        return (
            f"--advantage-estimator {algorithm.name} {algorithm.needs_group_because}: "
            "give --n-samples-per-prompt 2 or more"
        )


def off_policy_flags_consistent(config, platform):
    r = config.flags
    if not r.use_tis and (r.tis_clip is not None or r.tis_clip_low is not None):
        return "--tis-clip and --tis-clip-low only apply with --use-tis"
    if r.use_tis and r.tis_clip_low > r.tis_clip:
        return f"--tis-clip-low {r.tis_clip_low} is above --tis-clip {r.tis_clip}"
    if r.use_tis and r.use_rollout_logprobs:
        return (
            "--use-tis and --use-rollout-logprobs exclude each other: with the engine's logprobs as the old policy, "
            "the PPO ratio already weighs each token by pi / pi_rollout; drop one"
        )
    if r.rollout_rs is not None and r.rollout_rs_threshold is None:
        return f"--rollout-rs {r.rollout_rs} needs --rollout-rs-threshold (e.g. 0.999_1.001)"
    if r.rollout_rs_threshold is not None and r.rollout_rs is None:
        return "--rollout-rs-threshold only applies with --rollout-rs"


def debug_modes_consistent(config, platform):
    r = config.flags
    if r.debug_rollout_only and r.debug_train_only:
        return "--debug-rollout-only and --debug-train-only exclude each other"
    if r.debug_train_only and not r.load_rollout_data:
        return "--debug-train-only needs --load-rollout-data (saved by --save-rollout-data)"


EVAL_SET_NAME = re.compile(r"[A-Za-z0-9_.-]+")
EVAL_SAMPLING_FLAGS = (
    "eval_interval", "eval_n_samples_per_prompt", "eval_temperature", "eval_top_p", "eval_max_response_len",
)

# What --eval-only refuses: the flags that choose the training's prompts, schedule, checkpoints or actor, unset
# unless given. The training's other flags (--num-steps, batch sizes, optimizer, loss) have defaults: they are
# checked as for a run and unused (the dry-run says so).
EVAL_ONLY_REFUSED = (
    "prompt_data", "rollout_shuffle", "eval_interval", "save", "load", "save_rollout_data", "load_rollout_data",
    "dynamic_sampling", "over_sampling_batch_size", "rollout_max_prompts", "partial_rollout", "max_staleness",
    "debug_rollout_only", "use_rollout_routing_replay", "fused_output_logprobs",
)

# What --load-rollout-data refuses: the flags that choose how the training's rollouts are generated. And, unless an
# evaluation reads them (scores_samples), the flags that read and score prompts, unset unless given.
REPLAY_REFUSED = (
    "prompt_data", "rollout_shuffle", "dynamic_sampling", "over_sampling_batch_size", "rollout_max_prompts",
    "partial_rollout", "max_staleness", "debug_rollout_only",
)
READ_WITH_PROMPTS = (
    "reward_fn", "apply_chat_template", "apply_chat_template_kwargs", "system_prompt", "max_prompt_length",
    "skip_bad_rows", "rollout_clip_response_to_context", "tools", "max_turns", "custom_generate_function_path",
)


def eval_prompt_data_pairs(config, platform):
    values = config.flags.eval_prompt_data
    if values is None:
        return None
    example = "e.g. --eval-prompt-data held_out data/held_out.jsonl aime data/aime.parquet"
    if len(values) % 2:
        return (
            f"--eval-prompt-data takes NAME PATH pairs, got {len(values)} values ({' '.join(values)}): give each set "
            f"a name, {example}"
        )
    names = values[::2]
    for name in names:
        if not EVAL_SET_NAME.fullmatch(name):
            return (
                f"--eval-prompt-data: {name!r} is not a NAME (letters, digits, _ . -; it names the metrics "
                f"eval/NAME/...): the values are NAME PATH pairs, {example}"
            )
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        return f"--eval-prompt-data names {', '.join(repeated)} more than once: give each set its own NAME"


def eval_flags_consistent(config, platform):
    r = config.flags
    if r.eval_prompt_data is None:
        given = [_flag(dest) for dest in (*EVAL_SAMPLING_FLAGS, "eval_only") if _given(getattr(r, dest))]
        return f"{', '.join(given)} without --eval-prompt-data NAME PATH ...: nothing to evaluate" if given else None
    if not config.mode.has_engines:
        return "--eval-prompt-data needs the rollout engines, which --debug-train-only does not start; drop one"
    if config.mode is RunMode.EVAL_ONLY:
        return _unread_flags(
            r, EVAL_ONLY_REFUSED, "--eval-only evaluates --hf-checkpoint once, without training",
            "to evaluate a --save checkpoint, make it an HF directory with `relax convert` and pass that as "
            "--hf-checkpoint",
        )


def replay_flags_consistent(config, platform):
    r = config.flags
    if r.load_rollout_data is None or not config.mode.replays_rollouts:  # (--eval-only refuses it itself)
        return None
    replaying = "--load-rollout-data replays saved rollouts, scored, instead of generating them"
    if scores_samples(config):
        return _unread_flags(r, REPLAY_REFUSED, replaying)
    return _unread_flags(
        r, REPLAY_REFUSED + READ_WITH_PROMPTS, replaying,
        "without --eval-prompt-data the run reads no prompts and scores nothing",
    )


def _unread_flags(flags, dests, what_the_run_does: str, hint: str | None = None) -> str | None:
    """The flags among `dests` that were given, refused as doing nothing in a run that `what_the_run_does`."""
    given = [_flag(dest) for dest in dests if _given(getattr(flags, dest))]
    if given:
        return f"{what_the_run_does}: {', '.join(given)} would do nothing; drop them" + (f" ({hint})" if hint else "")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _given(value) -> bool:
    """A flag left unset is None (or False for a switch); 0 is a value given."""
    return value is not None and value is not False


def rollout_data_patterns_valid(config, platform):
    r = config.flags
    return pattern_problem("--save-rollout-data", r.save_rollout_data, r.num_steps) or pattern_problem(
        "--load-rollout-data", r.load_rollout_data, r.num_steps
    )


def batching_flags_consistent(config, platform):
    r = config.flags
    if r.use_dynamic_batch_size and not r.max_tokens_per_device:
        return "--use-dynamic-batch-size needs --max-tokens-per-device"
    if r.max_tokens_per_device and not r.use_dynamic_batch_size:
        return "--max-tokens-per-device only applies with --use-dynamic-batch-size"
    if r.log_probs_max_tokens_per_device and not r.use_dynamic_batch_size:
        return "--log-probs-max-tokens-per-device only applies with --use-dynamic-batch-size"


def sampling_flags_consistent(config, platform):
    r = config.flags
    # (relax.args filled both where a rollout is generated; elsewhere they are refused when given)
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.rollout_batch_size:
        return (
            f"--over-sampling-batch-size {r.over_sampling_batch_size} "
            f"is below --rollout-batch-size {r.rollout_batch_size}"
        )
    if r.rollout_max_prompts is not None:
        if r.rollout_max_prompts < r.rollout_batch_size:
            return (
                f"--rollout-max-prompts {r.rollout_max_prompts} is below --rollout-batch-size "
                f"{r.rollout_batch_size}: a step could never fill its batch"
            )
        problem = rollout_seeds_problem(r.rollout_max_prompts, r.n_samples_per_prompt)
        if problem:
            return problem
    if r.max_staleness is not None and not r.partial_rollout:
        return "--max-staleness bounds the age of --partial-rollout's continued responses: give --partial-rollout too"
    if r.partial_rollout and config.sglang.schedule_policy not in PRIORITY_SCHEDULE_POLICIES:
        return (
            f"--partial-rollout sends continued responses before new ones through SGLang's priority scheduling, "
            f"which --sglang-schedule-policy {config.sglang.schedule_policy} does not take: use one of "
            f"{', '.join(PRIORITY_SCHEDULE_POLICIES)}"
        )
    if r.partial_rollout and r.use_rollout_routing_replay:
        return (
            "--partial-rollout with --use-rollout-routing-replay: a checkpoint does not save the routed experts of "
            "the responses it carries to a later step; drop one"
        )
    if r.overlong_penalty_factor is not None and r.overlong_buffer_len is None:
        return "--overlong-penalty-factor only applies with --overlong-buffer-len"
    if r.overlong_buffer_len is not None and r.overlong_buffer_len >= r.rollout_max_response_len:
        return (
            f"--overlong-buffer-len {r.overlong_buffer_len} "
            f"must be below --rollout-max-response-len {r.rollout_max_response_len}"
        )


def chat_template_options_need_the_template(config, platform):
    r = config.flags
    options = (("--apply-chat-template-kwargs", r.apply_chat_template_kwargs), ("--system-prompt", r.system_prompt))
    given = [flag for flag, value in options if value is not None]
    if given and not r.apply_chat_template:
        return f"{' and '.join(given)} only apply with --apply-chat-template (they are options of the chat template)"


def tools_apply(config, platform):
    """--tools is loaded here (a user's module imported, each a Tool), so --dry-run finds a bad one."""
    r = config.flags
    if r.max_turns is not None and not r.tools:
        return "--max-turns bounds the turns of --tools' multi-turn samples: give --tools too"
    if not r.tools:
        return None
    if not r.apply_chat_template:
        return (
            "--tools without --apply-chat-template: the prompts show the tools, and the tool turns are written, "
            "through the tokenizer's chat template; give --apply-chat-template"
        )
    try:
        load_tools(r.tools, "--tools")
    except ValueError as error:
        return str(error)
    return None


def custom_generate_applies(config, platform):
    """--custom-generate-function-path is imported and its signature checked here, so --dry-run finds a bad one."""
    r = config.flags
    if r.custom_generate_function_path is None:
        return None
    flag = f"--custom-generate-function-path {r.custom_generate_function_path}"
    if r.tools:
        return f"{flag} with --tools: both say how a sample is generated (the function runs its own tools); drop one"
    if r.use_rollout_routing_replay:
        return (
            f"{flag} with --use-rollout-routing-replay: the function's samples do not carry the experts the engine "
            "chose; drop --use-rollout-routing-replay"
        )
    try:
        load_custom_generate_fn(r.custom_generate_function_path)
    except ValueError as error:
        return str(error)
    return None


def checkpoint_flags_consistent(config, platform):
    r = config.flags
    if r.save_interval is not None and not r.save:
        return "--save-interval needs --save"
    if r.save_hf is not None and not r.save:
        return (
            "--save-hf needs --save: the HF directories are written at the saves of --save (every --save-interval "
            "steps and at the end); add --save DIR"
        )
    if r.save_hf is not None and Path(r.save_hf).resolve() == Path(r.save).resolve():
        return f"--save-hf and --save are both {r.save}: their step_N directories would collide; give --save-hf its own"


def restarts_resume_from_checkpoints(config, platform):
    r = config.flags
    if r.max_restarts is None:
        return None
    if config.mode is RunMode.ROLLOUT_ONLY:
        return (
            "--max-restarts resumes the run from the actor's newest checkpoint; --debug-rollout-only has no actor "
            "and saves none: drop one"
        )
    if not r.save:
        return (
            "--max-restarts needs --save: a restarted run resumes from the newest checkpoint there; add --save DIR "
            "(and --save-interval N, which bounds the steps a restart redoes)"
        )


def grouped_experts_apply(config, platform):
    tc = config.megatron.transformer
    if not tc.moe_grouped_gemm:
        return None
    if not tc.num_moe_experts:
        return "--moe-grouped-gemm applies to MoE models only (no --num-experts, nor num_experts in config.json)"


def recompute_flags_apply(config, platform):
    """--recompute-granularity full | selective (--recompute-activations: selective) and the flags that shape it, as
    megatron-core 0.16 carries them out in relax's layers (megatron-core's own rules refused the rest already)."""
    tc, given = config.megatron.transformer, config.megatron.values.resolved
    shaping = [name for name in ("recompute_method", "recompute_num_layers", "recompute_modules") if name in given]
    if tc.recompute_granularity is None:
        if shaping:
            return (
                f"{', '.join(_flag(name) for name in shaping)} would do nothing without --recompute-granularity: give "
                "--recompute-granularity full (whole layers, with --recompute-method and --recompute-num-layers) or "
                "selective (the --recompute-modules; --recompute-activations), or drop them"
            )
        return None
    if tc.recompute_granularity == "full":
        if "recompute_modules" in given:
            return (
                "--recompute-modules picks the submodules of --recompute-granularity selective; full recomputes whole "
                "layers and would ignore it: drop --recompute-modules or use --recompute-granularity selective"
            )
        return None
    if "recompute_method" in given:
        return (
            "--recompute-method picks the layers of --recompute-granularity full; selective recomputes the "
            "--recompute-modules of every layer and would ignore it: drop --recompute-method or use full"
        )
    modules = set(tc.recompute_modules)
    if "layernorm" in modules:
        return (
            "--recompute-modules layernorm: megatron-core 0.16's layernorm recompute (CheckpointWithoutOutput) calls "
            "TransformerEngine's FP8 state even without FP8, and relax builds its layers without TransformerEngine "
            "(the training would stop with a NameError): drop layernorm"
        )
    freq = tc.moe_layer_freq
    every_layer_moe = bool(tc.num_moe_experts) and (freq == 1 if isinstance(freq, int) else all(f == 1 for f in freq))
    idle = sorted(modules & {"moe", "shared_experts"}) if not tc.num_moe_experts else []
    if tc.num_moe_experts and "shared_experts" in modules and not tc.moe_shared_expert_intermediate_size:
        idle.append("shared_experts")
    if every_layer_moe and "mlp" in modules:
        idle.append("mlp")
    if idle:
        return (
            f"--recompute-modules {' '.join(idle)}: this model has nothing of that kind to recompute (mlp: dense "
            "MLP layers; moe: MoE layers; shared_experts: a MoE layer's shared experts): drop it"
        )


def fused_output_logprobs_applies(config, platform):
    if config.flags.fused_output_logprobs and config.megatron.transformer.defer_embedding_wgrad_compute:
        return (
            "--fused-output-logprobs computes the output weight's gradient itself, while --defer-embedding-wgrad-"
            "compute defers the output layer's, which then never runs: drop one of them"
        )


def routing_replay_applies(config, platform):
    """--use-rollout-routing-replay: the engine returns each token's experts and the actor's routers replay them
    (relax.train.routing_replay), in every forward of a step, forward and backward alike."""
    r, tc = config.flags, config.megatron.transformer
    if not r.use_rollout_routing_replay:
        if tc.moe_enable_routing_replay:
            return (
                "--moe-enable-routing-replay alone replays nothing: relax's actor replays the experts the rollout "
                "engine chose with --use-rollout-routing-replay (which sets it); give that instead"
            )
        return None
    if not tc.num_moe_experts:
        return (
            "--use-rollout-routing-replay replays the experts a MoE model's routers chose, and this model has none "
            "(a dense model: no --num-experts, nor num_experts in config.json): drop it"
        )
    if config.mode is RunMode.ROLLOUT_ONLY:
        return "--use-rollout-routing-replay has no actor to replay into with --debug-rollout-only: drop one"
    balancing = tc.moe_router_load_balancing_type
    if "sinkhorn" in ([balancing] if isinstance(balancing, str) else balancing):
        return (
            "--use-rollout-routing-replay: megatron-core's sinkhorn router has no replay; choose another "
            "--moe-router-load-balancing-type"
        )
    if tc.moe_router_fusion:
        return "--use-rollout-routing-replay: megatron-core's fused router has no replay; drop --moe-router-fusion"
    recomputes_router = tc.recompute_granularity == "full" or (
        tc.recompute_granularity == "selective" and "moe" in (tc.recompute_modules or [])
    )
    if recomputes_router and tc.pipeline_model_parallel_size > 1:
        return (
            "--use-rollout-routing-replay with recomputed MoE layers (--recompute-granularity full, or "
            "--recompute-modules moe) and --pipeline-model-parallel-size > 1: a pipeline runs later micro-batches' "
            "forwards before a recomputing backward, which would replay their experts; drop the recompute or the "
            "pipeline stages"
        )


def gdn_training_kernel_imports(config, platform):
    """Checked where the run's device is this machine's (its workers import the kernel here too)."""
    kernel = config.flags.gdn_training_kernel
    if config.megatron.transformer.experimental_attention_variant != "gated_delta_net" or kernel not in KERNEL_PACKAGES:
        return None
    module, package = KERNEL_PACKAGES[kernel]
    if platform.unavailable_reason() is None and importlib.util.find_spec(module) is None:
        return (
            f"--gdn-training-kernel {kernel} needs {package}, which is not installed here: install it or pass "
            "--gdn-training-kernel reference"
        )


def gdn_training_kernel_takes_the_dtype(config, platform):
    """MindSpeed's chunked rule raises on float32 q/k/v, which a run without --bf16 / --fp16 gives it."""
    import torch

    if config.megatron.transformer.experimental_attention_variant != "gated_delta_net":
        return None
    if config.flags.gdn_training_kernel == "mindspeed" and config.megatron.transformer.params_dtype == torch.float32:
        return (
            "--gdn-training-kernel mindspeed does not take float32 (MindSpeed's chunked rule refuses it): train with "
            "--bf16, or pass --gdn-training-kernel reference"
        )


def gdn_training_kernel_compiles(config, platform):
    """relax's chunked rule runs Triton kernels, which on the CPU run only interpreted."""
    import triton

    if config.megatron.transformer.experimental_attention_variant != "gated_delta_net":
        return None
    if (config.flags.gdn_training_kernel == "relax" and platform.triton_target == "interpreter"
            and not triton.knobs.runtime.interpret):
        return (
            f"--gdn-training-kernel relax runs Triton kernels, which on the {platform.name} run only interpreted: set "
            "TRITON_INTERPRET=1 (slow; for tests and debugging), or pass --gdn-training-kernel reference"
        )


def sleep_route_exists(config, platform):
    if config.flags.actor_sleep_route == "memory-saver" and not platform.has_memory_saver:
        return (
            f"--actor-sleep-route memory-saver: the {platform.name} platform has no memory saver; use host-copies "
            "(or auto)"
        )


def wandb_imports(config, platform):
    """wandb is the one output package the stacks do not install (relax/pins.py OUTPUT_PACKAGES): the run's driver,
    which parses these flags, logs to it."""
    if config.flags.use_wandb and importlib.util.find_spec("wandb") is None:
        return (
            "--use-wandb logs through wandb, which is not installed: install it (pip install wandb) or leave out "
            "--use-wandb"
        )


def actor_memory_fits(config, platform):
    """--device-memory-gib: the actor's estimated peak per device (relax.args.memory) within what it may use."""
    r = config.flags
    if r.device_memory_gib is None:
        return None
    if not config.mode.has_actor:
        return "--device-memory-gib checks the training actor's memory, and this run starts none: drop it"
    if config.megatron.model.vocab_size is None:
        return (
            "--device-memory-gib needs the vocabulary size to estimate the logits: give --hf-checkpoint or "
            "--vocab-size"
        )
    available = memory_for_training(r, config.sglang)
    if available is None:
        return (
            "--device-memory-gib with the engines beside the actor (--no-colocate --rollout-num-devices 0) needs "
            "their share of the device: give --sglang-mem-fraction-static"
        )
    estimate = actor_memory(r, config.megatron, platform)
    if estimate.total <= available:
        return None
    return (
        f"the training actor is estimated to need {estimate.total / GIB:.1f} GiB per device, more than the "
        f"{available / GIB:.1f} GiB it may use of --device-memory-gib {r.device_memory_gib:g} ("
        + "; ".join(line.strip() for line in estimate.lines()[1:])
        + "): lower --max-tokens-per-device (or --micro-batch-size), split the model further (--tensor-model-"
        "parallel-size, --context-parallel-size), recompute activations (--recompute-granularity full) or shard "
        "the optimizer (--use-distributed-optimizer)"
    )


def megatron_features_fit_the_platform(config, platform):
    r = config.flags
    asked = [name for name in MEGATRON_FEATURE_FLAGS if getattr(r, name)]
    refused = [name for name in asked if name not in platform.megatron_features]
    if refused:
        flags = ", ".join("--" + name.replace("_", "-") for name in refused)
        return (
            f"{flags}: switches of the NPU's Megatron adaptation layer (MindSpeed); the {platform.name!r} platform has "
            "none: remove them"
        )
    tc = config.megatron.transformer
    if r.use_fused_moe_token_permute_and_unpermute and tc.moe_token_dispatcher_type != "alltoall":
        return (
            "--use-fused-moe-token-permute-and-unpermute needs --moe-token-dispatcher-type alltoall (MindSpeed's fused "
            f"permute is for that dispatcher), got {tc.moe_token_dispatcher_type!r}"
        )
    if r.use_fused_rmsnorm and tc.experimental_attention_variant == "gated_delta_net":
        return (
            "--use-fused-rmsnorm does not reach hybrid GDN models (qwen3_5, qwen3_next): their zero-centred RMSNorms "
            "are relax's own, not megatron's; remove it"
        )


RULES = [
    unsupported_combinations,
    required_flags,
    model_parallel_fits_devices,
    expert_parallel_fits,
    vocabulary_splits_over_tensor_parallel,
    rollout_fills_global_batches,
    global_batch_splits_over_data_parallel,
    engine_fits_devices,
    engines_within_pipeline_stages,
    colocation_releases_memory,
    engines_have_their_own_devices,
    lr_warmup_given_once,
    clip_range_ordered,
    dual_clip_applies,
    kl_loss_has_weight,
    kl_flags_need_kl_loss,
    std_normalisation_applies,
    groups_fit_the_estimator,
    off_policy_flags_consistent,
    debug_modes_consistent,
    rollout_data_patterns_valid,
    batching_flags_consistent,
    sampling_flags_consistent,
    eval_prompt_data_pairs,
    eval_flags_consistent,
    replay_flags_consistent,
    chat_template_options_need_the_template,
    tools_apply,
    custom_generate_applies,
    checkpoint_flags_consistent,
    restarts_resume_from_checkpoints,
    grouped_experts_apply,
    recompute_flags_apply,
    fused_output_logprobs_applies,
    routing_replay_applies,
    megatron_features_fit_the_platform,
    gdn_training_kernel_imports,
    gdn_training_kernel_takes_the_dtype,
    gdn_training_kernel_compiles,
    actor_memory_fits,
    wandb_imports,
    sleep_route_exists,
]


def check_config(flags, megatron, sglang, platform) -> list[str]:
    """Every rule's problem, in order; empty when the configuration is consistent."""
    parsed = Parsed(flags, megatron, sglang)
    return [problem for rule in RULES if (problem := rule(parsed, platform))]
