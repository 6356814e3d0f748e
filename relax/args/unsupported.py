"""What relax does not support: the one table, enforced when `relax train` parses its flags (so --dry-run accepts
only what a run carries out).

Four kinds of entry, each with its reason and what to use instead:
- REFUSED_FLAGS: Megatron-LM and MindSpeed flags relax knows and refuses (giving one is a parse error).
- REFUSED_VALUES: values a relax flag does not offer but a user may expect (e.g. an algorithm other trainers name).
- MANAGED_BY_RELAX: SGLang ServerArgs fields relax sets itself (--sglang-<field> and --sglang-config keys are
  refused, naming the relax flag to use).
- REFUSED_SGLANG_FIELDS (and every speculative_* field, every LoRA field, SERVER_ONLY_FIELDS): SGLang ServerArgs
  fields the engine relax drives cannot carry out or never reads (--sglang-<field> and --sglang-config keys are
  refused with the reason); refused_sglang_field reads them all.
- UNSUPPORTED_COMBINATIONS: values or combinations of accepted flags that no part of relax carries out.
And SLIME_FLAGS: slime flags that are not aliases of relax flags (relax.args.relax_flags.SLIME_SPELLINGS lists
those), because relax has no such setting or takes it in another form; giving one is an error that says what to do.
"""

import typing

from relax.args.settings import RunMode
from relax.train.context_parallel import REFUSED as CONTEXT_PARALLEL_REFUSED, Refusal


class Unsupported(typing.NamedTuple):
    setting: str  # the flag or combination, as a user writes it
    reason: str
    instead: str
    # For a combination: what of it was given, in the user's words (e.g. "--context-parallel-size 2"), or None.
    # Reads relax.args.checks.Parsed. None for a refused flag: the parser refuses the flag itself.
    given: typing.Callable[[typing.Any], str | None] | None = None

    def message(self, given: str | None = None) -> str:
        return f"{given or self.setting} is not supported: {self.reason}; {self.instead}"


REFUSED_FLAGS = [
    Unsupported(
        "--make-vocab-size-divisible-by",
        "relax trains the checkpoint's vocabulary unpadded, since SGLang engines receive the weights in HF shapes and "
        "sample over the HF vocabulary, which the actor's logprobs must match",
        "remove it (the vocabulary size must then divide by --tensor-model-parallel-size)",
    ),
    Unsupported(
        "--seq-length",
        "nothing in relax reads a fixed sequence length: each sample is trained whole, packed with others up to a "
        "token budget",
        "remove it; --max-prompt-length and --rollout-max-response-len bound a sample's length, "
        "--max-tokens-per-device a packed micro-batch's",
    ),
    Unsupported(
        "--use-fused-swiglu",
        "MindSpeed's argument of that name selects nothing: its SwiGLU feature replaces megatron's SwiGLU functions "
        "in every run (Ascend/MindSpeed core_r0.16.0, features_manager/fusions/fused_bias_swiglu.py)",
        "remove it; on an NPU, --bias-activation-fusion puts megatron's MLP on the SwiGLU function MindSpeed replaces",
    ),
]

# Values that are not among a relax flag's choices and are refused with what to give instead, where argparse would
# only list the choices. Each setting is spelled "--flag value".
REFUSED_VALUES = [
    Unsupported(
        "--advantage-estimator dapo",
        "it would compute GRPO's advantages and change nothing else",
        "DAPO is --advantage-estimator grpo with clip-higher (--eps-clip-high, e.g. 0.28), --dynamic-sampling and "
        "--overlong-buffer-len, and the token-mean loss that is the default; give those instead",
    ),
]

# ServerArgs fields relax sets itself, and what the user sets instead.
MANAGED_BY_RELAX = {
    "model_path": "use --hf-checkpoint",
    "tokenizer_path": "use --hf-checkpoint (the tokenizer is read from it)",
    "tp_size": "use --rollout-num-devices-per-engine",
    "port": "relax's placement picks a free port per engine; remove it",
    "nccl_port": "relax's placement picks a free port per engine; remove it",
    "dist_init_addr": "relax's placement sets it; remove it",
    "base_gpu_id": "relax's placement assigns devices; remove it",
    "enable_memory_saver": "use --colocate (on by default; the memory saver follows it where the platform has one)",
    "device": "use --device",
    "enable_return_routed_experts": "use --use-rollout-routing-replay (the actor then replays what the engine returns)",
    "enable_priority_scheduling": (
        "relax turns it on with --partial-rollout (a continued response's request goes before new ones)"
    ),
    "schedule_low_priority_values_first": "relax gives continued responses the higher priority value",
    "default_chat_template_kwargs": (
        "use --apply-chat-template-kwargs (relax renders the prompts and sends the engine token ids)"
    ),
}

# SGLang ServerArgs fields whose setting relax's engines cannot carry out: one in-process engine per
# --rollout-num-devices-per-engine devices of one node, tensor-parallel over them, its weights pushed by the actor.
# Their own default (what relax runs with) is kept; giving the flag is an error.
REFUSED_SGLANG_FIELDS = {
    "pp_size": Unsupported(
        "--sglang-pp-size",
        "relax places an engine on --rollout-num-devices-per-engine devices as its tensor-parallel ranks and pushes "
        "each weight bucket to those ranks; pipeline stages would run on devices outside the engine's placement",
        "remove it; --rollout-num-devices-per-engine sets an engine's devices",
    ),
    "nnodes": Unsupported(
        "--sglang-nnodes",
        "relax starts each engine in one process on one node; an engine spanning nodes would wait for processes "
        "on other nodes that nothing starts",
        "remove it; relax places engines over --num-nodes itself, one node per engine",
    ),
    "node_rank": Unsupported(
        "--sglang-node-rank",
        "relax starts each engine in one process on one node (node rank 0 of its own engine)",
        "remove it; relax places engines over --num-nodes itself, one node per engine",
    ),
    "disaggregation_mode": Unsupported(
        "--sglang-disaggregation-mode",
        "relax's engine serves prefill and decode itself; a prefill-only or decode-only engine would wait for a "
        "peer engine and bootstrap server that nothing starts",
        "remove it",
    ),
}
SPECULATIVE = Unsupported(
    "--sglang-speculative-*",
    "speculative decoding is not carried out: the weight push does not update a draft model, which would keep "
    "proposing tokens from the initial weights",
    "remove it",
)
LORA = Unsupported(
    "--sglang-*lora*",
    "LoRA adapters are not carried out: the weight push updates the base model's weights only, so an adapter would "
    "keep its initial weights while the policy trains",
    "remove it; the actor trains every weight of the model",
)
# Read only by SGLang's HTTP and gRPC servers (sglang serve), which relax does not start: its engines run in the
# engine actor's process (sglang.Engine), called directly.
SERVER_ONLY = Unsupported(
    "--sglang-<HTTP or gRPC server field>",
    "only SGLang's HTTP or gRPC server reads it, and relax starts none: each engine runs inside its Ray actor "
    "(sglang.Engine), called directly",
    "remove it",
)
SERVER_ONLY_FIELDS = {
    "api_key", "admin_api_key", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs", "ssl_keyfile_password",
    "enable_ssl_refresh", "enable_http2", "http2_max_concurrent_streams", "http2_initial_connection_window_size",
    "enable_http_worker_reuseport", "log_level_http", "uvicorn_access_log_exclude_prefixes", "skip_server_warmup",
    "tool_server", "grpc_mode", "smg_grpc_mode", "grpc_port", "smg_http_sidecar_port", "grpc_response_timeout_secs",
}


def refused_sglang_field(field: str) -> Unsupported | None:
    """Why the SGLang ServerArgs field is refused, or None where relax takes it."""
    if field.startswith("speculative_"):
        return SPECULATIVE
    if "lora" in field:
        return LORA
    if field in SERVER_ONLY_FIELDS:
        return SERVER_ONLY
    return REFUSED_SGLANG_FIELDS.get(field)


# slime flag -> what to do in relax (answered for the unknown flag instead of the closest spelling, which misleads).
SLIME_FLAGS = {
    "--custom-rm-path": (
        "slime's reward function (module.function, called as f(args, sample) on slime's Sample) does not fit relax's: "
        "use --reward-fn module:function, a function whose first parameter is `sample` (relax.rollout.rewards."
        "RewardInput: prompt, response, label, metadata) or `samples` (a list of them)"
    ),
    "--disable-grpo-std-normalization": "relax spells it --no-normalize-advantages-by-std",
}


def _context_parallel_with(refusal: Refusal) -> typing.Callable[[typing.Any], str | None]:
    """`given` of context parallelism combined with what `refusal` names."""

    def given(parsed) -> str | None:
        tc = parsed.megatron.transformer
        if tc.context_parallel_size > 1 and refusal.applies(tc):
            return f"--context-parallel-size {tc.context_parallel_size} with {refusal.what}"
        return None

    return given


# What context parallelism does not do yet (relax.train.context_parallel.REFUSED), by what it is combined with.
CONTEXT_PARALLEL = {
    refusal.what: Unsupported(
        f"--context-parallel-size above 1 with {refusal.what}", refusal.reason, "use --context-parallel-size 1",
        _context_parallel_with(refusal),
    )
    for refusal in CONTEXT_PARALLEL_REFUSED
}


def _grouped_experts_recomputing_moe_act(parsed) -> str | None:
    tc = parsed.megatron.transformer
    recomputed = tc.recompute_granularity == "selective" and "moe_act" in (tc.recompute_modules or [])
    return "--recompute-modules moe_act with --moe-grouped-gemm" if tc.moe_grouped_gemm and recomputed else None


def _multi_token_prediction(parsed) -> str | None:
    layers = parsed.megatron.transformer.mtp_num_layers
    return f"--mtp-num-layers {layers}" if layers is not None else None


def _position_embedding(parsed) -> str | None:
    kind = parsed.megatron.model.position_embedding_type
    return f"--position-embedding-type {kind}" if kind != "rope" else None


def _checkpoints_without_actor(parsed) -> str | None:
    f = parsed.flags
    given = [flag for flag, value in (("--save", f.save), ("--load", f.load)) if value is not None]
    return f"{' and '.join(given)} with --debug-rollout-only" if parsed.mode is RunMode.ROLLOUT_ONLY and given else None


def _engine_copies(parsed) -> str | None:
    # With --sglang-enable-dp-attention (deprecated) SGLang reads --sglang-dp-size as --sglang-attn-dp-size.
    sglang = parsed.sglang
    return f"--sglang-dp-size {sglang.dp_size}" if sglang.dp_size > 1 and not sglang.enable_dp_attention else None


def _log_interval(parsed) -> str | None:
    interval = parsed.flags.log_interval
    return f"--log-interval {interval}" if interval != 1 else None


UNSUPPORTED_COMBINATIONS = [
    Unsupported(
        "--save / --load with --debug-rollout-only",
        "without a training actor there is nothing to checkpoint",
        "drop them",
        _checkpoints_without_actor,
    ),
    Unsupported("--log-interval other than 1", "every step is logged", "drop it", _log_interval),
    Unsupported(
        "--sglang-dp-size above 1",
        "SGLang would start that many copies of the engine (its data-parallel attention is --sglang-attn-dp-size), "
        "each on --rollout-num-devices-per-engine devices of its own, while relax places an engine on those devices "
        "only: the copies would land on other engines' devices or on none",
        "drop it: relax already runs one engine per --rollout-num-devices-per-engine devices and spreads the "
        "rollouts over them; for data-parallel attention inside one engine, give --sglang-attn-dp-size",
        _engine_copies,
    ),
    *CONTEXT_PARALLEL.values(),
    Unsupported(
        "--recompute-modules moe_act with --moe-grouped-gemm",
        "relax's grouped experts keep their activations",
        "drop moe_act from --recompute-modules",
        _grouped_experts_recomputing_moe_act,
    ),
    Unsupported(
        "--mtp-num-layers",
        "relax's actor builds no multi-token-prediction layers (it trains the next-token policy the engines sample "
        "from), and megatron-core's GPTModel given the number without them cuts each row's hidden states into that "
        "many more pieces",
        "remove it",
        _multi_token_prediction,
    ),
    Unsupported(
        "--position-embedding-type other than rope",
        "the actor builds every model family with rotary position embeddings, as their HF checkpoints do",
        "give rope or drop the flag",
        _position_embedding,
    ),
]


def unsupported_combinations(parsed, platform) -> str | None:
    """A rule of relax.args.checks: every unsupported combination that was given, one per line."""
    problems = [entry.message(given) for entry in UNSUPPORTED_COMBINATIONS if (given := entry.given(parsed))]
    return "\n".join(problems) or None
