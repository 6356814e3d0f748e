"""relax's own flags: data, rollout, reward, algorithm, training, resources, checkpoints, logging, device, debug.

Their dests carry no prefix; SGLang's start with `sglang_` and Megatron's with `megatron_`, which is how
the parsed namespace is split into the three configuration objects.
"""

import argparse
import json

from relax.kernels.gdn_training import GDN_TRAINING_KERNELS
from relax.platform import DEVICE_CHOICES
from relax.rollout.multi_turn import DEFAULT_MAX_TURNS
from relax.rollout.rollout import DEFAULT_MAX_CHUNKS
from relax.train.algorithms import ALGORITHMS
from relax.train.losses import AGGREGATIONS, DUAL_CLIP, K3_CLAMP, LOG_RATIO_CLAMP

LOSS_AGGREGATIONS = [name.replace("_", "-") for name in AGGREGATIONS]  # verl's loss_agg_mode spelling
OVERLONG_PENALTY_FACTOR_DEFAULT = 1.0  # DAPO's
DEFAULT_ESTIMATOR = "grpo"
TIS_CLIP_DEFAULTS = {"tis_clip": 2.0, "tis_clip_low": 0.0}  # with --use-tis (slime's defaults)

# Switches of the NPU's Megatron adaptation layer (MindSpeed), by dest, spelled as MindSpeed spells them: each given
# one reaches its repatch in every training rank (Platform.prepare_megatron's feature_args).
MEGATRON_FEATURE_FLAGS = {
    "use_fused_rmsnorm": "RMSNorm of megatron's layer specs (Qwen2/Qwen3 norms).",
    "use_fused_rotary_pos_emb": "RoPE of the softmax-attention layers.",
    "use_fused_moe_token_permute_and_unpermute": "MoE token permute and unpermute (needs --moe-token-dispatcher-type "
    "alltoall).",
}
BUILTIN_REWARD_HINT = "a built-in reward name (e.g. math) or module:function"
REWARD_TIMEOUT_DEFAULT = 60.0  # seconds per call: far above a rule-based score, short of a silent hang
# Bounds on the driver's waits for calls that can hang while every process runs: far above what a large model
# takes (loading hundreds of GB from a shared filesystem, an hour of long-response sampling), short of days.
ENGINE_START_TIMEOUT_DEFAULT = 3600.0
ROLLOUT_TIMEOUT_DEFAULT = 4 * 3600.0
WEIGHT_SYNC_TIMEOUT_DEFAULT = 3600.0
TRAIN_TIMEOUT_DEFAULT = 4 * 3600.0

# slime's spellings of relax flags, for users coming from slime: each names the same setting in the same unit and
# value format, and is a second option string of the relax flag (so --help lists it). Giving both spellings is an
# error (StrictArgumentParser's aliases), not argparse's silent last-wins. Flags slime spells as relax does need no
# entry; slime flags without a relax flag of the same meaning are answered by relax.args.unsupported.SLIME_FLAGS.
SLIME_SPELLINGS = {
    "--num-steps": "--num-rollout",
    "--rollout-num-devices-per-engine": "--rollout-num-gpus-per-engine",
    "--max-tokens-per-device": "--max-tokens-per-gpu",  # both per data-parallel rank's micro-batch
    "--log-probs-max-tokens-per-device": "--log-probs-max-tokens-per-gpu",
    "--num-nodes": "--actor-num-nodes",  # colocated: the actor's nodes are the engines' too
    "--num-devices-per-node": "--actor-num-gpus-per-node",
    "--rollout-num-devices": "--rollout-num-gpus",  # --no-colocate: the engines' own devices
    "--max-prompt-length": "--rollout-max-prompt-len",
    "--kl-coef": "--kl-loss-coef",  # slime's own --kl-coef is a penalty on the reward, which relax does not have
}


def _spellings(flag: str) -> tuple[str, ...]:
    """The option strings of a relax flag: its own, then slime's where slime spells it differently."""
    return (flag, SLIME_SPELLINGS[flag]) if flag in SLIME_SPELLINGS else (flag,)


def _by_estimator(default_of) -> str:
    """A default that depends on --advantage-estimator, for --help: the default estimator's, then each other's
    that differs (e.g. "0.2; gspo: 0.0003")."""
    default = default_of(ALGORITHMS[DEFAULT_ESTIMATOR])
    others = [f"{a.name}: {default_of(a)}" for a in ALGORITHMS.values() if default_of(a) != default]
    return "; ".join([str(default), *others])


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _ratio_bounds(text: str) -> tuple[float, float]:
    """LOW_HIGH, or HIGH alone for (1/HIGH, HIGH): bounds around a ratio of 1 (verl's rollout_rs_threshold)."""
    low_text, sep, high_text = text.partition("_")
    try:
        high = float(high_text if sep else text)
        low = float(low_text) if sep else 1.0 / high
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW_HIGH (e.g. 0.999_1.001) or HIGH (e.g. 1.001)") from None
    if not 0 < low <= 1 <= high or low == high:
        raise argparse.ArgumentTypeError(f"{text!r}: the bounds must satisfy 0 < LOW <= 1 <= HIGH and LOW < HIGH")
    return low, high


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _timeout(text: str) -> float | None:
    return None if text == "none" else _positive_float(text)


def _reward_fn(text: str) -> str:
    module, sep, function = text.partition(":")
    if sep and not (module and function.isidentifier()):
        raise argparse.ArgumentTypeError(f"{text!r} is not module:function")
    if not sep and not text.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not {BUILTIN_REWARD_HINT}")
    return text


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object like '{{\"enable_thinking\": false}}'")
    return value


def add_relax_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("relax: data")
    g.add_argument(
        "--prompt-data",
        metavar="PATH",
        help="Prompt dataset: a .jsonl or .parquet file, a `datasets` save_to_disk directory or a Hub-style dataset "
        "directory (data files under it, e.g. data/train-*.parquet; its train split). Required for a run, except one "
        "that replays --load-rollout-data or runs --eval-only.",
    )
    g.add_argument(
        "--input-key",
        default="prompt",
        help="Column holding the prompt: a string or a list of {role, content} chat messages (default: %(default)s).",
    )
    g.add_argument("--label-key", default="label", help="Column holding the reference answer (default: %(default)s).")
    g.add_argument(
        "--metadata-key",
        default="metadata",
        help="Column passed to the reward function as-is, a JSON object; rows may lack it (default: %(default)s).",
    )
    g.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="Render each prompt with the tokenizer's chat template (needed for chat-message prompts).",
    )
    g.add_argument(
        "--apply-chat-template-kwargs",
        type=_json_object,
        metavar="JSON",
        help="Options of the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}' for Qwen3.",
    )
    g.add_argument(
        "--system-prompt",
        metavar="TEXT",
        help="System message put before each prompt (not before messages that start with their own system message).",
    )
    g.add_argument("--rollout-shuffle", action="store_true", help="Shuffle prompts each epoch (seeded by --seed).")
    g.add_argument(
        *_spellings("--max-prompt-length"),
        metavar="TOKENS",
        type=_positive_int,
        help="Drop prompts longer than this many tokens (default: no limit).",
    )
    g.add_argument(
        "--skip-bad-rows",
        action="store_true",
        help="Count and skip unusable rows (a missing key, invalid JSON, ...) instead of failing on the first.",
    )

    g = parser.add_argument_group("relax: rollout")
    g.add_argument(
        "--rollout-batch-size", type=_positive_int, default=32, help="Prompts per step (default: %(default)s)."
    )
    g.add_argument(
        "--n-samples-per-prompt",
        type=_positive_int,
        default=8,
        help="Responses sampled per prompt (default: %(default)s).",
    )
    g.add_argument(
        "--rollout-max-response-len",
        type=_positive_int,
        default=1024,
        help="Max new tokens per response (default: %(default)s).",
    )
    g.add_argument(
        "--rollout-clip-response-to-context",
        action="store_true",
        help="Give a prompt whose prompt + --rollout-max-response-len (or --eval-max-response-len) tokens would not "
        "fit the model's context length (the smaller of config.json's max_position_embeddings and "
        "--sglang-context-length) the response budget that does fit, instead of refusing the data before the run; "
        "the start says how many prompts are clipped and the smallest budget. A prompt that fills the context alone "
        "is refused either way.",
    )
    g.add_argument(
        "--rollout-temperature", type=float, default=1.0, help="Sampling temperature (default: %(default)s)."
    )
    g.add_argument("--rollout-top-p", type=float, default=1.0, help="Nucleus sampling p (default: %(default)s).")
    g.add_argument("--rollout-top-k", type=int, default=-1, help="Top-k sampling, -1 for off (default: %(default)s).")
    g.add_argument(
        "--rollout-stop-token-ids", type=int, nargs="+", metavar="ID", help="Extra token ids that end a response."
    )
    g.add_argument(
        *_spellings("--rollout-num-devices-per-engine"),
        metavar="N",
        type=_positive_int,
        default=1,
        help="Devices per SGLang engine, i.e. its tensor-parallel size (default: %(default)s).",
    )
    g.add_argument(
        "--dynamic-sampling",
        action="store_true",
        help="Drop prompt groups whose rewards are all equal (DAPO) and refill.",
    )
    g.add_argument(
        "--over-sampling-batch-size",
        type=_positive_int,
        help="Prompts submitted at a time while fewer groups are in flight than the step still needs; groups are "
        "taken as they complete, and once --rollout-batch-size are kept the rest are aborted and their prompts put "
        "back for the next step. Above --rollout-batch-size it over-samples against the long tail (default: "
        "--rollout-batch-size, no over-sampling).",
    )
    g.add_argument(
        "--partial-rollout",
        action="store_true",
        help="Groups aborted when the step's batch is full keep what their responses generated (tokens, engine "
        "logprobs, the step that sampled each token) and a later step continues them from there, rather than "
        "starting their prompts again; their training uses the logprobs they carry (TIS/MIS and the mismatch "
        "metrics see the older tokens). Applies where groups are aborted: --over-sampling-batch-size above "
        "--rollout-batch-size, or --dynamic-sampling. A --custom-generate-function-path function's ABORTED sample is "
        "kept as it returned it and given back to the function to continue.",
    )
    g.add_argument(
        "--max-staleness",
        type=_non_negative_int,
        metavar="STEPS",
        help="With --partial-rollout: a response with a token sampled more than STEPS steps before the step that "
        "would continue it starts again from its prompt, counted in rollout/partial_stale_samples (default: no "
        "bound).",
    )
    g.add_argument(
        "--tools",
        nargs="+",
        metavar="TOOL",
        help="Multi-turn tool use: the tools the model may call, each a built-in (calculator, python: code run in a "
        "sandboxed process) or a user's Tool object or class as module:function. The prompts show them to the chat "
        "template; a response that calls one (Qwen's <tool_call> JSON) gets the tools' output as the template's "
        "tool turn and goes on, until the model answers without a call, --max-turns, or --rollout-max-response-len "
        "tokens, appended ones included. Only the model's own tokens are trained (the loss mask). Needs "
        "--apply-chat-template.",
    )
    g.add_argument(
        "--max-turns",
        type=_positive_int,
        metavar="N",
        help=f"With --tools: assistant turns per sample (each an engine request, but a turn cut by an abort and "
        f"continued with --partial-rollout counts once); a sample still calling tools at the last one ends there "
        f"(finish reason length) (default: {DEFAULT_MAX_TURNS}).",
    )
    g.add_argument(
        "--custom-generate-function-path",
        metavar="FUNCTION",
        help="slime's custom generate function, module.path.function or module:function: an async function called "
        "as fn(args, sample, sampling_params) (evaluation=... too where it declares it) once per sample in place "
        "of relax's own request; it generates through relax.rollout.custom_generate.generate and returns the "
        "sample with its tokens, loss_mask and rollout_log_probs (docs/training.md). Evaluations sample through it "
        "too.",
    )
    g.add_argument(
        "--rollout-max-prompts",
        type=_positive_int,
        metavar="N",
        help="Prompts one step's rollout may submit before the run stops, with the counts of groups kept, dropped "
        "and failed, rather than train on a short batch (default: "
        f"{DEFAULT_MAX_CHUNKS} x --over-sampling-batch-size).",
    )
    g.add_argument(
        "--overlong-buffer-len",
        type=_positive_int,
        help="DAPO overlong shaping: responses longer than --rollout-max-response-len minus this are penalised "
        "(default: off).",
    )
    g.add_argument(
        "--overlong-penalty-factor",
        type=_positive_float,
        help="With --overlong-buffer-len: the penalty at --rollout-max-response-len tokens, subtracted from the "
        f"reward (default: {OVERLONG_PENALTY_FACTOR_DEFAULT}).",
    )

    g = parser.add_argument_group("relax: evaluation")
    g.add_argument(
        "--eval-prompt-data",
        nargs="+",
        metavar="NAME PATH",
        help="Held-out prompt sets to evaluate the policy on, as NAME PATH pairs (a PATH as --prompt-data takes; "
        "read with the same keys and prompt formatting, scored by --reward-fn); metrics under eval/NAME/.",
    )
    g.add_argument(
        "--eval-interval",
        type=_positive_int,
        metavar="N",
        help="Evaluate every N steps; with --eval-prompt-data the policy is always evaluated before the first step "
        "and after the last (default: only then).",
    )
    g.add_argument(
        "--eval-n-samples-per-prompt",
        type=_positive_int,
        metavar="K",
        help="Responses sampled per eval prompt; pass@k is reported for k = 1, 2, 4, ... up to K (default: 1).",
    )
    g.add_argument(
        "--eval-temperature",
        type=float,
        help="Eval sampling temperature, 0 for greedy (default: --rollout-temperature).",
    )
    g.add_argument("--eval-top-p", type=float, help="Eval nucleus sampling p (default: --rollout-top-p).")
    g.add_argument(
        "--eval-max-response-len",
        type=_positive_int,
        metavar="TOKENS",
        help="Max new tokens per eval response (default: --rollout-max-response-len).",
    )
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="Evaluate --hf-checkpoint on --eval-prompt-data once and exit: no training actor, no steps. Refuses "
        "the flags of the training's prompts, schedule and checkpoints (--prompt-data, --eval-interval, --save, ...); "
        "the other training flags (--num-steps, batch sizes, optimizer, loss) are checked as for a run but unused.",
    )

    g = parser.add_argument_group("relax: reward")
    g.add_argument(
        "--reward-fn",
        type=_reward_fn,
        help=f"Reward function: {BUILTIN_REWARD_HINT}. Required wherever samples are generated and scored: the "
        "rollouts of a run, and evaluations (--eval-prompt-data); refused where nothing is (--load-rollout-data "
        "without --eval-prompt-data).",
    )
    g.add_argument(
        "--reward-timeout",
        type=_timeout,
        default=REWARD_TIMEOUT_DEFAULT,
        metavar="SECONDS",
        help="Each call of the reward function (a sample's, or a per-batch function's batch) that does not return "
        "within this many seconds scores 0.0 and is counted in rollout/reward_timeouts; the step goes on. A sync "
        "function then runs in worker processes of its own, a stuck one killed and replaced; `none`: no bound, "
        "sync functions run in the driver (default: %(default)s).",
    )

    g = parser.add_argument_group("relax: algorithm")
    g.add_argument(
        "--advantage-estimator",
        choices=list(ALGORITHMS),
        default=DEFAULT_ESTIMATOR,
        help="The algorithm: its advantages and its policy loss. "
        + "; ".join(f"{a.name}: {a.summary}" for a in ALGORITHMS.values())
        + " (default: %(default)s).",
    )
    g.add_argument(
        "--eps-clip",
        type=_non_negative_float,
        help=f"PPO ratio clip, lower side (default: {_by_estimator(lambda a: a.clip_range[0])}).",
    )
    g.add_argument(
        "--eps-clip-high",
        type=_non_negative_float,
        help="PPO ratio clip, upper side (default: --eps-clip; without --eps-clip: "
        f"{_by_estimator(lambda a: a.clip_range[1])}).",
    )
    g.add_argument(
        "--eps-clip-c",
        type=_positive_float,
        help="Dual-clip: a token with a negative advantage A loses at most -A x this (> 1), however far its ratio "
        f"has grown; not with {', '.join(a.name for a in ALGORITHMS.values() if not a.dual_clip)}, whose weights "
        f"are capped already (default: {DUAL_CLIP}).",
    )
    g.add_argument(
        "--log-ratio-clamp",
        type=_positive_float,
        default=LOG_RATIO_CLAMP,
        help="|log(pi / pi_old)| (and the k3 KL's |log(pi / reference)|) is clamped to this before exp, so one "
        "token far off the old policy gives a large finite ratio, not inf (default: %(default)s).",
    )
    g.add_argument(
        *_spellings("--kl-coef"),
        metavar="C",
        type=float,
        default=0.0,
        help="Weight of the KL-to-reference term in the loss; needs --use-kl-loss (default: %(default)s: no "
        "reference model).",
    )
    g.add_argument(
        "--kl-loss-type",
        choices=["k1", "k2", "k3"],
        help="KL estimator of the --use-kl-loss term (default: k3).",
    )
    g.add_argument(
        "--k3-clamp",
        type=_positive_float,
        help=f"With --use-kl-loss and the k3 estimator: the largest per-token KL estimate (default: {K3_CLAMP}).",
    )
    g.add_argument(
        "--use-kl-loss",
        action="store_true",
        help="Put --kl-coef x KL(policy || reference) in the loss (relax has no KL penalty on the reward).",
    )
    g.add_argument("--entropy-coef", type=float, default=0.0, help="Entropy bonus coefficient (default: %(default)s).")
    g.add_argument(
        "--loss-aggregation",
        choices=LOSS_AGGREGATIONS,
        help="How per-token losses become one: the mean over the batch's tokens, the mean over sequences of "
        "each one's token mean or token sum, or the token sum over (sequences x --rollout-max-response-len) "
        f"(Dr. GRPO) (default: {_by_estimator(lambda a: a.aggregation.replace('_', '-'))}).",
    )
    g.add_argument(
        "--normalize-advantages-by-std",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Divide group-centred rewards by the group's std (GRPO; off for Dr. GRPO).",
    )

    g = parser.add_argument_group("relax: off-policy correction")
    g.add_argument(
        "--use-tis",
        action="store_true",
        help="Truncated importance sampling: weight each token's policy gradient by pi_old / pi_rollout, clamped "
        "into [--tis-clip-low, --tis-clip].",
    )
    g.add_argument(
        "--tis-clip",
        type=_positive_float,
        help=f"With --use-tis: the weight's cap (default: {TIS_CLIP_DEFAULTS['tis_clip']}).",
    )
    g.add_argument(
        "--tis-clip-low",
        type=_non_negative_float,
        help=f"With --use-tis: the weight's floor (default: {TIS_CLIP_DEFAULTS['tis_clip_low']}).",
    )
    g.add_argument(
        "--rollout-rs",
        choices=["seq_mean_k1"],
        help="Masked importance sampling: drop the sequences whose geometric-mean ratio pi_old / pi_rollout "
        "leaves the --rollout-rs-threshold bounds (default: off).",
    )
    g.add_argument(
        "--rollout-rs-threshold",
        type=_ratio_bounds,
        metavar="LOW_HIGH",
        help="With --rollout-rs: the bounds as LOW_HIGH (e.g. 0.999_1.001), or HIGH alone for 1/HIGH_HIGH.",
    )
    g.add_argument(
        "--use-rollout-logprobs",
        action="store_true",
        help="Take the engine's logprobs as the PPO old policy instead of the actor's (mismatch metrics still "
        "compare the two).",
    )
    g.add_argument(
        "--use-rollout-routing-replay",
        action="store_true",
        help="MoE models (R3): the engine returns the experts its routers chose for every token, and the actor's "
        "forwards (old-policy, reference, training) route each token to those experts instead of choosing again, "
        "so routing adds nothing to the rollout-training mismatch.",
    )

    g = parser.add_argument_group("relax: training")
    g.add_argument(
        *_spellings("--num-steps"),
        metavar="N",
        type=_positive_int,
        default=100,
        help="RL steps (rollout + train) to run (default: %(default)s).",
    )
    g.add_argument(
        "--global-batch-size",
        type=_positive_int,
        help="Samples per optimizer step "
        "(default: --rollout-batch-size x --n-samples-per-prompt, one step per rollout).",
    )
    g.add_argument(
        "--micro-batch-size", type=_positive_int, default=1, help="Samples per forward/backward (default: %(default)s)."
    )
    g.add_argument(
        "--use-dynamic-batch-size", action="store_true", help="Pack micro-batches up to --max-tokens-per-device tokens."
    )
    g.add_argument(
        *_spellings("--max-tokens-per-device"),
        metavar="TOKENS",
        type=_positive_int,
        help="Token budget of a packed micro-batch on one device (a micro-batch split over --context-parallel-size "
        "devices holds that many times as many tokens).",
    )
    g.add_argument(
        "--device-memory-gib",
        metavar="GIB",
        type=_positive_float,
        help="Memory of one training device: a layout whose estimated training peak per device (parameters, "
        "gradients, optimizer state, one micro-batch's activations and logits; --dry-run prints it) exceeds it, less "
        "the engines' --sglang-mem-fraction-static where they stay resident beside the actor, is refused before "
        "the run starts (default: no check).",
    )
    g.add_argument(
        "--gdn-training-kernel",
        choices=["auto", *GDN_TRAINING_KERNELS],
        default="auto",
        help="Chunked gated delta rule of the actor's GDN layers (Qwen3.5, Qwen3-Next): fla (flash-linear-attention's "
        "Triton kernels), mindspeed (MindSpeed's Triton kernels for Ascend NPUs, in half precision), reference "
        "(relax's torch version, any device) or relax (relax's Triton state pass over every packed sequence at once; "
        "CUDA, or the CPU under TRITON_INTERPRET=1); auto: the device's default (default: %(default)s).",
    )
    g.add_argument(
        *_spellings("--log-probs-max-tokens-per-device"),
        metavar="TOKENS",
        type=_positive_int,
        help="Token budget of a packed micro-batch in the forward-only passes (old-policy and reference logprobs), "
        "which keep no activations for backward, on one device as --max-tokens-per-device (default: that one).",
    )
    g.add_argument(
        "--fused-output-logprobs",
        action="store_true",
        help="Compute the logprobs and entropies from the output layer's input and weight, a piece of positions at a "
        "time, never holding the [tokens, vocab / TP] logits, their transposed copy or their gradient (the backward "
        "recomputes each piece's logits). Saves the largest activation of long sequences; its speed on a GPU is not "
        "measured yet (default: off).",
    )
    g.add_argument(
        "--seed", type=int, default=1234, help="Seed for data order, sampling and Megatron init (default: %(default)s)."
    )

    g = parser.add_argument_group(
        "relax: fused NPU kernels (MindSpeed's switches, passed to its repatch in every training rank; --device npu)"
    )
    for dest, text in MEGATRON_FEATURE_FLAGS.items():
        g.add_argument("--" + dest.replace("_", "-"), action="store_true", help=text)

    g = parser.add_argument_group("relax: resources and colocation")
    g.add_argument(
        *_spellings("--num-nodes"), metavar="N", type=_positive_int, default=1, help="Nodes (default: %(default)s)."
    )
    g.add_argument(
        *_spellings("--num-devices-per-node"),
        metavar="N",
        type=_positive_int,
        default=1,
        help="Accelerators (or CPU workers) per node (default: %(default)s).",
    )
    g.add_argument(
        "--colocate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Training and rollout share the same devices, releasing memory in turn. --no-colocate: the engines run "
        "on --rollout-num-devices devices of their own (or, with 0, beside the actor on its devices) and generate the "
        "next step's rollout while the actor trains (one step off-policy; docs/training.md).",
    )
    g.add_argument(
        *_spellings("--rollout-num-devices"),
        metavar="N",
        type=_non_negative_int,
        default=None,
        help="With --no-colocate: the engines' devices (Ray bundles on the CPU), placed after the actor's "
        "--num-nodes x --num-devices-per-node, one engine per --rollout-num-devices-per-engine of them. 0: the "
        "engines run beside the actor on its devices, both resident (neither sleeps; on a GPU or NPU the engines keep "
        "the share of each device --sglang-mem-fraction-static gives them and the actor has the rest), the weights "
        "pushed as colocated.",
    )
    g.add_argument(
        "--actor-sleep-route",
        choices=("auto", "memory-saver", "host-copies"),
        default="auto",
        help="How the sleeping actor hands its device memory to the engines: memory-saver (the platform's "
        "torch_memory_saver pauses the training state's region, keeping a host backup), host-copies (relax copies every "
        "storage of the state to pinned host memory and frees it), or auto (default): the platform's choice, "
        "host-copies on CUDA (measured faster on an H200, docs/benchmarks.md) and the CPU, memory-saver on NPU.",
    )
    g.add_argument(
        "--update-weight-buffer-size",
        type=_positive_int,
        default=512 * 1024**2,
        help="Bytes per weight-sync bucket (default: %(default)s = 512 MiB).",
    )

    g = parser.add_argument_group("relax: faults")
    g.add_argument(
        "--max-engine-restarts",
        type=_non_negative_int,
        default=3,
        metavar="N",
        help="An engine (or its SGLang scheduler or detokenizer) that dies or stops answering in any phase (rollout, "
        "device hand-over, weight push, evaluation) is started again on its devices, in the other engines' state, "
        "given the actor's current weights before it generates, and the call it missed is made again; the step "
        "goes on. At most this many restarts per run, then the run fails naming the engine (or, with "
        "--max-restarts, restarts from its newest checkpoint); 0: fail at the first (default: %(default)s; with "
        "--no-colocate, a restarted engine waits for the weights the others generate with: relax.run.loop_async). "
        "Counted in faults/engine_restarts and faults/engine_restart_seconds.",
    )
    g.add_argument(
        "--engine-start-timeout",
        type=_timeout,
        default=ENGINE_START_TIMEOUT_DEFAULT,
        metavar="SECONDS",
        help="How long an engine may take to start (weights loaded) at the run's start or after a restart; "
        "`none`: no bound (default: %(default)s, for a large checkpoint on a slow filesystem).",
    )
    g.add_argument(
        "--rollout-timeout",
        type=_timeout,
        default=ROLLOUT_TIMEOUT_DEFAULT,
        metavar="SECONDS",
        help="How long an engine may take to answer its share of one generate call; an engine that does not is "
        "restarted as a dead one is (--max-engine-restarts); `none`: no bound (default: %(default)s, hours of "
        "long-response sampling).",
    )
    g.add_argument(
        "--weight-sync-timeout",
        type=_timeout,
        default=WEIGHT_SYNC_TIMEOUT_DEFAULT,
        metavar="SECONDS",
        help="How long each part of handing the devices over may take: the engines' memory release and resume, "
        "the actor's wake and sleep, and the weight push (with the process groups it builds); past it the run "
        "fails naming the worker that did not answer; `none`: no bound (default: %(default)s).",
    )
    g.add_argument(
        "--train-timeout",
        type=_timeout,
        default=TRAIN_TIMEOUT_DEFAULT,
        metavar="SECONDS",
        help="How long the training ranks may take for each of their other calls: one step's training (old-policy "
        "and reference logprobs, the optimizer steps), a checkpoint save or load, and closing the weight-sync "
        "groups; past it the run fails naming the rank that did not answer (a rank stuck in a collective); "
        "`none`: no bound (default: %(default)s, a long step of a large model).",
    )

    g = parser.add_argument_group("relax: checkpoints")
    g.add_argument(
        "--hf-checkpoint",
        metavar="DIR",
        help="HF model directory: the engine's weights and the model architecture. Required for a run.",
    )
    g.add_argument(
        "--load", metavar="DIR", help="Megatron checkpoint to resume from (default: start from --hf-checkpoint)."
    )
    g.add_argument("--save", metavar="DIR", help="Where to write Megatron checkpoints (default: no checkpoints).")
    g.add_argument("--save-interval", type=_positive_int, help="Save every N steps (needs --save).")
    g.add_argument(
        "--max-restarts",
        type=_positive_int,
        metavar="N",
        help="When a training rank fails (its process dies, or a call on it raises), or an engine fails outside a "
        "rollout or an evaluation or past --max-engine-restarts, end the run's workers and resume from the newest "
        "complete checkpoint in --save (from the start when none is saved yet), at most N times in all; then the run "
        "fails. Needs --save; counted in faults/run_restarts and the summary (default: no restart).",
    )
    g.add_argument(
        "--save-hf",
        metavar="DIR",
        help="At every save (needs --save: every --save-interval steps, at the end, on a stop signal) also write the "
        "actor's weights as an HF directory DIR/step_N that transformers and SGLang load: safetensors under HF "
        "names, --hf-checkpoint's config, tokenizer and generation config. `relax convert` makes the same "
        "directory from a saved step later.",
    )

    g = parser.add_argument_group("relax: logging")
    g.add_argument(
        "--output-dir",
        default="outputs",
        help="The run's record: metrics.jsonl, TensorBoard events, the reward curve (default: %(default)s). A new "
        "run refuses a directory holding an earlier run's record; a run resumed with --load continues its own.",
    )
    g.add_argument(
        "--overwrite-output-dir",
        action="store_true",
        help="Let a new run replace the record an earlier run left in --output-dir (deleted when the run starts).",
    )
    g.add_argument("--use-wandb", action="store_true", help="Log metrics to Weights & Biases.")
    g.add_argument("--wandb-project", default="relax", help="W&B project (default: %(default)s).")
    g.add_argument(
        "--log-interval", type=_positive_int, default=1, help="Log metrics every N steps (default: %(default)s)."
    )
    g.add_argument(
        "--verbose",
        action="store_true",
        help="Show every line on the console. By default the console shows relax's lines, the progress bar and "
        "upstream errors (tracebacks, ERROR lines); upstream warnings and info lines (SGLang, Megatron, Ray, ...) go "
        "only to the run's log, <--output-dir>/run.log, which holds every line either way.",
    )
    g.add_argument(
        "--engine-logs",
        action="store_true",
        help="SGLang logs at info level (a line per prefill and decode batch: throughput, token usage, cached "
        "tokens) and the engines' lines are shown on the console. A --sglang-log-level given as well sets the level.",
    )

    g = parser.add_argument_group("relax: device")
    g.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help="Platform; auto picks npu, then cuda, then cpu (default: %(default)s).",
    )

    g = parser.add_argument_group("relax: debug")
    g.add_argument("--debug-rollout-only", action="store_true", help="Run rollouts only; no training actor.")
    g.add_argument(
        "--debug-train-only", action="store_true", help="Train on --load-rollout-data only; no rollout engine."
    )
    g.add_argument(
        "--save-rollout-data",
        metavar="PATTERN",
        help="Write each step's scored samples to this path, {step} replaced by the step "
        "(e.g. dumps/step_{step}.jsonl; format in relax/rollout/dump.py); with --use-rollout-routing-replay, the "
        "engine's routed experts beside it.",
    )
    g.add_argument(
        "--load-rollout-data",
        metavar="PATTERN",
        help="Replay the samples --save-rollout-data wrote instead of generating (without {step}: one file, "
        "replayed at every step). Refuses the flags of generating the rollouts (--prompt-data, --rollout-shuffle, "
        "--dynamic-sampling, ...), and --reward-fn and the prompt format flags unless --eval-prompt-data reads them.",
    )
    g.add_argument(
        "--dry-run", action="store_true", help="Validate every flag, print the resolved configuration and exit."
    )
