"""Cross-field rules: each one fires with a message naming the flags, and a consistent run passes them all."""

import argparse
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import DRY_RUN as RUN, REQUIRED, TINY_SIZE as SIZE, parse_error
from relax.args import parse_train_args
from relax.args.checks import Parsed, colocation_releases_memory
from relax.platform import platform_facts
from relax.rollout.multi_turn import DEFAULT_MAX_TURNS, ToolRollout
from relax.rollout.rollout import Partial
from relax.ray.watch import Timeout
from relax.tools.tiny_model import build_tiny_model


RULES = {
    "required flags": (["--device", "cpu", "--dry-run", *SIZE], "missing --prompt-data, --reward-fn, --lr"),
    "checkpoint required outside --dry-run": (
        [*REQUIRED, *SIZE],
        "missing --hf-checkpoint (only --dry-run may leave it out)",
    ),
    "TP x PP x CP vs devices": (
        [
            *RUN,
            "--num-devices-per-node",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--pipeline-model-parallel-size",
            "2",
        ],
        "--tensor-model-parallel-size 2 x --pipeline-model-parallel-size 2 x --context-parallel-size 1 = 4 "
        "does not divide "
        "the 2 devices (--num-nodes 1 x --num-devices-per-node 2)",
    ),
    "EP needs experts (megatron-core's own rule)": (
        [*RUN, "--expert-model-parallel-size", "2"],
        "megatron-core TransformerConfig rejects these flags: num_moe_experts must be non None to use expert-parallel",
    ),
    "EP divides experts": (
        [
            *RUN,
            "--num-devices-per-node",
            "2",
            "--num-experts",
            "3",
            "--moe-router-topk",
            "2",
            "--expert-model-parallel-size",
            "2",
        ],
        "--expert-model-parallel-size 2 does not divide the 3 experts",
    ),
    "EP x ETP x PP vs devices": (
        [*RUN, "--num-devices-per-node", "2", "--num-experts", "4", "--expert-model-parallel-size", "4"],
        "--expert-model-parallel-size 4 x expert tensor parallel 1 x --pipeline-model-parallel-size 1 = 4 "
        "does not divide the 2 devices",
    ),
    "vocabulary splits over TP (relax does not pad it)": (
        [*RUN, "--num-devices-per-node", "2", "--tensor-model-parallel-size", "2", "--vocab-size", "301"],
        "the vocabulary of 301 tokens (config.json's vocab_size or --vocab-size) does not divide over "
        "--tensor-model-parallel-size 2",
    ),
    "rollout samples vs global batch": (
        [*RUN, "--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
        "--rollout-batch-size 3 x --n-samples-per-prompt 2 = 6 samples is not a multiple of --global-batch-size 4",
    ),
    "global batch vs micro batch x DP": (
        [
            *RUN,
            "--num-devices-per-node",
            "2",
            "--rollout-batch-size",
            "6",
            "--n-samples-per-prompt",
            "1",
            "--micro-batch-size",
            "2",
        ],
        "--global-batch-size 6 is not a multiple of --micro-batch-size 2 x data-parallel size 2 = 4",
    ),
    "global batch vs DP with dynamic batches": (
        [*RUN, "--num-devices-per-node", "4", "--rollout-batch-size", "6", "--n-samples-per-prompt", "1"]
        + ["--use-dynamic-batch-size", "--max-tokens-per-device", "4096"],
        "--global-batch-size 6 is not a multiple of data-parallel size 4 = 4",
    ),
    "engine TP divides devices": (
        [*RUN, "--num-devices-per-node", "3", "--rollout-batch-size", "3", "--n-samples-per-prompt", "1"]
        + ["--rollout-num-devices-per-engine", "2"],
        "--rollout-num-devices-per-engine 2 does not divide the 3 devices",
    ),
    "engines within pipeline stages where handles stay on their device": (
        [*RUN, "--num-devices-per-node", "4", "--pipeline-model-parallel-size", "2"]
        + ["--rollout-num-devices-per-engine", "4"],
        "--rollout-num-devices-per-engine 4 does not divide the 2 devices of each pipeline stage (4 devices / "
        "--pipeline-model-parallel-size 2): on 'cpu' an engine takes its weights from the training ranks on its own "
        "devices",
    ),
    "eps clip order": (
        [*RUN, "--eps-clip", "0.2", "--eps-clip-high", "0.1"],
        "--eps-clip-high 0.1 is below --eps-clip 0.2",
    ),
    "KL loss needs a coefficient": ([*RUN, "--use-kl-loss"], "--use-kl-loss with --kl-coef 0 adds nothing"),
    "debug modes exclusive": (
        [*RUN, "--debug-rollout-only", "--debug-train-only", "--load-rollout-data", "d"],
        "--debug-rollout-only and --debug-train-only exclude each other",
    ),
    "train-only needs saved rollouts": ([*RUN, "--debug-train-only"], "--debug-train-only needs --load-rollout-data"),
    "dynamic batches need a token budget": (
        [*RUN, "--use-dynamic-batch-size"],
        "--use-dynamic-batch-size needs --max-tokens-per-device",
    ),
    "token budget needs dynamic batches": (
        [*RUN, "--max-tokens-per-device", "4096"],
        "--max-tokens-per-device only applies with --use-dynamic-batch-size",
    ),
    "over-sampling at least the batch": (
        [*RUN, "--over-sampling-batch-size", "16"],
        "--over-sampling-batch-size 16 is below --rollout-batch-size 32",
    ),
    "the prompt bound at least the batch": (
        [*RUN, "--dynamic-sampling", "--rollout-max-prompts", "16"],
        "--rollout-max-prompts 16 is below --rollout-batch-size 32: a step could never fill its batch",
    ),
    "the prompt bound fits the step's seeds": (
        [*RUN, "--n-samples-per-prompt", "8", "--rollout-max-prompts", "3000000"],
        "--rollout-max-prompts 3000000 x --n-samples-per-prompt 8 is more requests than a step has sampling seeds "
        "for (16777216); give at most 2097152 prompts",
    ),
    "staleness bound needs partial rollout": (
        [*RUN, "--max-staleness", "2"],
        "--max-staleness bounds the age of --partial-rollout's continued responses: give --partial-rollout too",
    ),
    "partial rollout with a schedule policy priority scheduling does not take": (
        [*RUN, "--partial-rollout", "--sglang-schedule-policy", "lpm"],
        "which --sglang-schedule-policy lpm does not take: use one of fcfs, lof",
    ),
    "a user's priority scheduling switch": (
        [*RUN, "--sglang-enable-priority-scheduling"],
        "is set by relax: relax turns it on with --partial-rollout",
    ),
    "partial rollout with routing replay": (
        [*RUN, "--num-experts", "4", "--partial-rollout", "--use-rollout-routing-replay"],
        "--partial-rollout with --use-rollout-routing-replay: a checkpoint does not save the routed experts",
    ),
    "max turns needs tools": (
        [*RUN, "--max-turns", "3"],
        "--max-turns bounds the turns of --tools' multi-turn samples: give --tools too",
    ),
    "tools need the chat template": (
        [*RUN, "--tools", "calculator"],
        "--tools without --apply-chat-template: the prompts show the tools, and the tool turns are written, through "
        "the tokenizer's chat template; give --apply-chat-template",
    ),
    "tools name tools": (
        [*RUN, "--apply-chat-template", "--tools", "calculator", "json:dumps"],
        "--tools json:dumps: its name is None, not a non-empty string",
    ),
    "tools import": (
        [*RUN, "--apply-chat-template", "--tools", "no_such_module:tool"],
        "--tools no_such_module:tool: cannot import module 'no_such_module'",
    ),
    "custom generate function without tools": (
        [*RUN, "--custom-generate-function-path", "test_custom_generate:two_turns", "--apply-chat-template",
         "--tools", "calculator"],
        "--custom-generate-function-path test_custom_generate:two_turns with --tools: both say how a sample is "
        "generated",
    ),
    "custom generate function without routing replay": (
        [*RUN, "--num-experts", "4", "--custom-generate-function-path", "test_custom_generate:two_turns",
         "--use-rollout-routing-replay"],
        "with --use-rollout-routing-replay: the function's samples do not carry the experts the engine chose",
    ),
    "custom generate function imports": (
        [*RUN, "--custom-generate-function-path", "no_such_module.generate"],
        "--custom-generate-function-path no_such_module.generate: cannot import module 'no_such_module'",
    ),
    "custom generate function is async": (
        [*RUN, "--custom-generate-function-path", "json.dumps"],
        "--custom-generate-function-path json.dumps: not an async function",
    ),
    "overlong penalty factor needs the buffer": (
        [*RUN, "--overlong-penalty-factor", "0.5"],
        "--overlong-penalty-factor only applies with --overlong-buffer-len",
    ),
    "overlong buffer below max response": (
        [*RUN, "--overlong-buffer-len", "1024"],
        "--overlong-buffer-len 1024 must be below --rollout-max-response-len 1024",
    ),
    "chat template options need the template": (
        [*RUN, "--system-prompt", "Be brief.", "--apply-chat-template-kwargs", '{"enable_thinking": false}'],
        "--apply-chat-template-kwargs and --system-prompt only apply with --apply-chat-template",
    ),
    "save interval needs save": ([*RUN, "--save-interval", "10"], "--save-interval needs --save"),
    "HF directories need save": ([*RUN, "--save-hf", "hf"], "--save-hf needs --save"),
    "restarts need save": ([*RUN, "--max-restarts", "2"], "--max-restarts needs --save: a restarted run resumes"),
    "restarts need training ranks": (
        [*RUN, "--max-restarts", "2", "--save", "checkpoints", "--debug-rollout-only"],
        "--max-restarts resumes the run from the actor's newest checkpoint; --debug-rollout-only has no actor",
    ),
    "HF directories beside the checkpoints": (
        [*RUN, "--save", "checkpoints", "--save-hf", "checkpoints/"],
        "--save-hf and --save are both checkpoints: their step_N directories would collide",
    ),
    "grouped experts need experts": ([*RUN, "--moe-grouped-gemm"], "--moe-grouped-gemm applies to MoE models only"),
    "routing replay needs experts": (
        [*RUN, "--use-rollout-routing-replay"], "--use-rollout-routing-replay replays the experts a MoE model's"
    ),
    "routing replay needs an actor": (
        [*RUN, "--num-experts", "4", "--use-rollout-routing-replay", "--debug-rollout-only"],
        "--use-rollout-routing-replay has no actor to replay into with --debug-rollout-only",
    ),
    "routing replay has no sinkhorn": (
        [*RUN, "--num-experts", "4", "--use-rollout-routing-replay", "--moe-router-load-balancing-type", "sinkhorn"],
        "megatron-core's sinkhorn router has no replay",
    ),
    "routing replay and recompute across pipeline stages": (
        [*RUN, "--num-devices-per-node", "2", "--num-experts", "4", "--use-rollout-routing-replay",
         "--pipeline-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "1"],
        "which would replay their experts",
    ),
    "recompute shapes without a granularity": (
        [*RUN, "--recompute-method", "block", "--recompute-modules", "mlp"],
        "--recompute-method, --recompute-modules would do nothing without --recompute-granularity",
    ),
    "full recompute takes no modules": (
        [*RUN, "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
         "--recompute-modules", "mlp"],
        "--recompute-modules picks the submodules of --recompute-granularity selective",
    ),
    "selective recompute takes no method": (
        [*RUN, "--recompute-activations", "--recompute-method", "uniform"],
        "--recompute-method picks the layers of --recompute-granularity full",
    ),
    "layernorm recompute needs TransformerEngine": (
        [*RUN, "--recompute-activations", "--recompute-modules", "core_attn", "layernorm"],
        "--recompute-modules layernorm: megatron-core 0.16's layernorm recompute",
    ),
    "MoE recompute on a dense model": (
        [*RUN, "--recompute-activations", "--recompute-modules", "moe", "shared_experts"],
        "--recompute-modules moe shared_experts: this model has nothing of that kind to recompute",
    ),
    "dense MLP recompute when every layer is MoE": (
        [*RUN, "--num-experts", "4", "--recompute-activations", "--recompute-modules", "mlp", "moe"],
        "--recompute-modules mlp: this model has nothing of that kind to recompute",
    ),
    "shared experts recompute without shared experts": (
        [*RUN, "--num-experts", "4", "--recompute-activations", "--recompute-modules", "shared_experts"],
        "--recompute-modules shared_experts: this model has nothing of that kind to recompute",
    ),
    "the fused output layer computes its weight's gradient itself": (
        [*RUN, "--fused-output-logprobs", "--defer-embedding-wgrad-compute", "--gradient-accumulation-fusion",
         "--pipeline-model-parallel-size", "2", "--num-devices-per-node", "2"],
        "--fused-output-logprobs computes the output weight's gradient itself",
    ),
    "megatron's replay switch alone": (
        [*RUN, "--num-experts", "4", "--moe-enable-routing-replay"],
        "--moe-enable-routing-replay alone replays nothing",
    ),
    "the engines' own devices only apart": (
        [*RUN, "--rollout-num-gpus", "2"],
        "--rollout-num-devices (--rollout-num-gpus) is read only with --no-colocate",
    ),
    "apart, the engines need devices": (
        [*RUN, "--no-colocate"], "--no-colocate needs --rollout-num-devices N (--rollout-num-gpus)"
    ),
    "apart, the engines fill their devices": (
        [*RUN, "--no-colocate", "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"],
        "--rollout-num-devices-per-engine 2 does not divide the --rollout-num-devices 3 devices of the engines",
    ),
    "apart, no sleep route": (
        [*RUN, "--no-colocate", "--rollout-num-gpus", "1", "--actor-sleep-route", "host-copies"],
        "--actor-sleep-route host-copies with --no-colocate: the actor never sleeps",
    ),
    "apart, no debug mode": (
        [*RUN, "--no-colocate", "--rollout-num-gpus", "1", "--debug-rollout-only"],
        "--no-colocate with --debug-rollout-only starts no actor to run beside the engines; drop --no-colocate",
    ),
    "MindSpeed switches off NPU": (
        [*RUN, "--use-fused-rmsnorm", "--use-fused-rotary-pos-emb"],
        "--use-fused-rmsnorm, --use-fused-rotary-pos-emb: switches of the NPU's Megatron adaptation layer (MindSpeed); the "
        "'cpu' platform has none",
    ),
}

NPU_RUN = [arg if arg != "cpu" else "npu" for arg in RUN]
NPU_RULES = {
    "fused permute needs alltoall": (
        [*NPU_RUN, "--use-fused-moe-token-permute-and-unpermute"],
        "--use-fused-moe-token-permute-and-unpermute needs --moe-token-dispatcher-type alltoall",
    ),
}


@pytest.mark.parametrize("rule", list(NPU_RULES))
def test_mindspeed_switch_rules_on_npu(rule, capsys):
    argv, message = NPU_RULES[rule]
    assert message in parse_error(argv, capsys)
    switches = ["--bias-activation-fusion", "--use-fused-rotary-pos-emb", "--use-fused-rmsnorm"]
    config = parse_train_args([*NPU_RUN, *switches])
    assert set(config.run.megatron_features) == {"use_fused_rotary_pos_emb", "use_fused_rmsnorm"}


@pytest.mark.parametrize("rule", list(RULES))
def test_rule_fires_naming_the_flags(rule, capsys):
    argv, message = RULES[rule]
    assert message in parse_error(argv, capsys)


def test_partial_rollout_schedules_continued_responses_first():
    assert parse_train_args([*RUN, "--partial-rollout"]).sglang.enable_priority_scheduling
    assert not parse_train_args(RUN).sglang.enable_priority_scheduling


def test_a_consistent_multi_device_run_passes():
    argv = [*RUN, "--num-nodes", "2", "--num-devices-per-node", "4", "--tensor-model-parallel-size", "2"]
    argv += ["--rollout-num-devices-per-engine", "4", "--rollout-batch-size", "16", "--n-samples-per-prompt", "4"]
    argv += ["--global-batch-size", "32", "--micro-batch-size", "2", "--eps-clip-high", "0.28"]
    config = parse_train_args(argv)
    assert (config.algorithm.global_batch_size, config.actor.loss.clip_high) == (32, 0.28)


def test_grouped_experts_pass_with_experts_and_expert_parallelism():
    argv = [*RUN, "--num-devices-per-node", "2", "--num-experts", "4", "--moe-grouped-gemm"]
    argv += ["--expert-model-parallel-size", "2", "--recompute-activations"]
    transformer = parse_train_args(argv).megatron.transformer
    assert transformer.moe_grouped_gemm and transformer.expert_model_parallel_size == 2


def test_tools_reach_the_engines_and_the_prompts():
    rollout = parse_train_args([*RUN, "--apply-chat-template", "--tools", "calculator", "python"]).rollout
    assert rollout.tools == ToolRollout(("calculator", "python"), DEFAULT_MAX_TURNS, {})
    assert [tool["function"]["name"] for tool in rollout.data.tools] == ["calculator", "python"]
    assert parse_train_args([*RUN, "--apply-chat-template", "--tools", "calculator", "--max-turns", "2"]
                            ).rollout.tools.max_turns == 2
    assert parse_train_args(RUN).rollout.tools is None and parse_train_args(RUN).rollout.data.tools == ()


def test_tools_take_partial_rollout_which_continues_their_multi_turn_samples():
    config = parse_train_args([*RUN, "--apply-chat-template", "--tools", "calculator", "--partial-rollout",
                               "--max-staleness", "2"])
    assert config.rollout.tools.tools == ("calculator",) and config.rollout.partial == Partial(max_staleness=2)
    assert config.sglang.enable_priority_scheduling


def test_a_custom_generate_function_takes_partial_rollout_which_continues_its_aborted_samples():
    config = parse_train_args([*RUN, "--custom-generate-function-path", "test_custom_generate:two_turns",
                               "--partial-rollout", "--max-staleness", "1"])
    assert config.rollout.partial == Partial(max_staleness=1) and config.sglang.enable_priority_scheduling
    assert config.rollout.custom_generate.as_namespace("127.0.0.1", 30000).partial_rollout  # slime's switch


def test_a_custom_generate_function_reaches_the_engines_with_slimes_args():
    generate = parse_train_args([*RUN, "--custom-generate-function-path", "test_custom_generate.two_turns",
                                 "--n-samples-per-prompt", "4"]).rollout.custom_generate
    args = generate.as_namespace("127.0.0.1", 30000)  # the engine actor's /generate endpoint
    assert generate.spec == "test_custom_generate.two_turns"
    assert (args.n_samples_per_prompt, args.rollout_max_response_len) == (4, 1024)
    assert args.n_samples_per_eval_prompt is None  # no --eval-prompt-data
    assert (args.sglang_router_ip, args.sglang_router_port) == ("127.0.0.1", 30000)
    # slime's switches functions branch on, and the requests an engine runs at once (one engine: every group x 4)
    assert (args.use_rollout_routing_replay, args.partial_rollout) == (False, False)
    assert args.sglang_server_concurrency == args.rollout_batch_size * 4
    assert parse_train_args(RUN).rollout.custom_generate is None
    # an evaluation samples through it, without a rollout too
    replay_and_evaluate = [*REPLAY, *EVAL_SET, "--reward-fn", "math"]
    function = ["--custom-generate-function-path", "test_custom_generate:two_turns"]
    assert parse_train_args([*replay_and_evaluate, *function]).rollout.custom_generate.spec == function[1]


def test_routing_replay_turns_on_the_engines_experts_and_the_actors_replay():
    config = parse_train_args([*RUN, "--num-experts", "4", "--use-rollout-routing-replay"])
    assert config.sglang.enable_return_routed_experts and config.megatron.transformer.moe_enable_routing_replay
    assert config.rollout.routing_replay
    config = parse_train_args([*RUN, "--num-experts", "4"])
    assert not config.sglang.enable_return_routed_experts and not config.megatron.transformer.moe_enable_routing_replay
    assert not config.rollout.routing_replay


def test_routing_replay_replays_saved_rollouts():
    # saved rollouts keep the engine's experts (relax.rollout.dump), so a replayed step trains as the saved run did
    config = parse_train_args([*TRAIN_ONLY, "--num-experts", "4", "--use-rollout-routing-replay"])
    assert config.rollout.routing_replay and config.rollout.load_data == "rollouts/{step}.jsonl"


# Runs that replay saved rollouts: they read no prompts; only an evaluation (on the engines) scores anything.
REPLAY = ["--lr", "1e-6", "--device", "cpu", "--dry-run", *SIZE, "--load-rollout-data", "rollouts/{step}.jsonl"]
TRAIN_ONLY = [*REPLAY, "--debug-train-only"]
EVAL_SET = ["--eval-prompt-data", "held_out", "h.jsonl"]


@pytest.mark.parametrize("argv", [REPLAY, TRAIN_ONLY, [*REPLAY, *EVAL_SET, "--reward-fn", "math"]],
                         ids=["replay", "train only", "replay and evaluate"])
def test_a_replaying_run_needs_no_prompt_data(argv):
    config = parse_train_args(argv)
    assert config.rollout.data is None and config.rollout.load_data == "rollouts/{step}.jsonl"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*TRAIN_ONLY, "--prompt-data", "p.jsonl", "--rollout-shuffle", "--dynamic-sampling"],
         "--load-rollout-data replays saved rollouts, scored, instead of generating them: --prompt-data, "
         "--rollout-shuffle, --dynamic-sampling would do nothing; drop them"),
        ([*REPLAY, "--debug-rollout-only"], ": --debug-rollout-only would do nothing"),
        ([*TRAIN_ONLY, "--reward-fn", "math"], ": --reward-fn would do nothing; drop them (without "
         "--eval-prompt-data the run reads no prompts and scores nothing)"),
        ([*REPLAY, "--apply-chat-template", "--system-prompt", "Be brief.", "--max-prompt-length", "8"],
         ": --apply-chat-template, --system-prompt, --max-prompt-length would do nothing"),
        ([*REPLAY, *EVAL_SET, "--reward-fn", "math", "--prompt-data", "p.jsonl"], ": --prompt-data would do nothing; "
         "drop them\n"),  # (the reward function is read: no hint about it)
        ([*REPLAY, *EVAL_SET], "missing --reward-fn"),  # the evaluation scores its samples
        ([*TRAIN_ONLY, "--rollout-clip-response-to-context"], ": --rollout-clip-response-to-context would do nothing"),
        ([*REPLAY, "--over-sampling-batch-size", "64", "--rollout-max-prompts", "640"],
         ": --over-sampling-batch-size, --rollout-max-prompts would do nothing"),
        ([*REPLAY, "--partial-rollout", "--max-staleness", "1"], ": --partial-rollout, --max-staleness would do nothing"),
        ([*TRAIN_ONLY, "--custom-generate-function-path", "m.f"], ": --custom-generate-function-path would do "
         "nothing"),
    ],
    ids=["generating flags", "no actor", "unscored", "prompt format", "evaluating", "eval needs reward", "no engine",
         "no over-sampling", "no partial rollout", "no custom generate function"],
)
def test_a_replaying_run_refuses_what_it_does_not_read(argv, message, capsys):
    assert message in parse_error(argv, capsys)


def test_a_replaying_run_that_evaluates_reads_the_reward_function_and_the_prompt_format():
    config = parse_train_args([*REPLAY, *EVAL_SET, "--reward-fn", "math", "--apply-chat-template"])
    assert config.rollout.reward_fn == "math" and config.evaluation.datasets["held_out"].apply_chat_template


TINY_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run-tiny-cpu.sh"


@pytest.fixture(scope="module")
def tiny_exp_dir(tmp_path_factory):
    """An EXP_DIR holding the tiny model where scripts/run-tiny-cpu.sh builds it, and an interpreter stand-in that
    prints its arguments one per line (the script's model and data builds then do nothing)."""
    exp_dir = tmp_path_factory.mktemp("tiny")
    build_tiny_model(exp_dir / "model", "qwen3")
    recorder = exp_dir / "python"
    recorder.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    recorder.chmod(0o755)
    return exp_dir


def _tiny_script_config(exp_dir: Path, args: list[str]):
    """The config of the `relax train` flags the script passes with `args` (the interpreter stand-in prints them)."""
    env = {**os.environ, "EXP_DIR": str(exp_dir), "RELAX_PYTHON": str(exp_dir / "python")}
    env.pop("RELAX_DRY_RUN", None)
    printed = subprocess.run(
        ["bash", str(TINY_SCRIPT), *args], env=env, capture_output=True, text=True, check=True
    ).stdout
    return parse_train_args(printed.split("-m\nrelax.cli\ntrain\n", 1)[1].splitlines())


@pytest.mark.parametrize(
    "mode",
    [[], ["--eval-only"], ["--load-rollout-data", "r_{step}.jsonl"],
     ["--debug-train-only", "--load-rollout-data", "r_{step}.jsonl"]],
    ids=["run", "eval only", "replay", "train only"],
)
def test_the_tiny_scripts_flags_pass_the_checks_in_each_mode(tiny_exp_dir, mode):
    config = _tiny_script_config(tiny_exp_dir, mode)
    replays = "--load-rollout-data" in mode
    assert (config.rollout.data is None) == (replays or "--eval-only" in mode)
    assert (config.rollout.reward_fn is None) == ("--debug-train-only" in mode)


@pytest.mark.parametrize(
    "flags, use_rollout_logprobs, tis",
    [([], False, False), (["--no-colocate", "--rollout-num-gpus", "1"], True, False),
     (["--no-colocate", "--rollout-num-gpus", "1", "--use-tis"], False, True),
     (["--over-sampling-batch-size", "32", "--partial-rollout"], True, False)],
    ids=["colocated", "apart", "apart with tis", "partial rollout"],
)
def test_the_tiny_script_takes_the_engines_logprobs_as_the_old_policy_only_off_policy(
    tiny_exp_dir, flags, use_rollout_logprobs, tis
):
    """With --no-colocate or --partial-rollout (samples of an older policy) the script adds --use-rollout-logprobs
    (docs/benchmarks.md), unless --use-tis, which excludes it, is given; the colocated run keeps the actor's
    logprobs."""
    correction = _tiny_script_config(tiny_exp_dir, flags).actor.rollout_correction
    assert correction.use_rollout_logprobs == use_rollout_logprobs
    assert (correction.tis_clip is not None) == tis


def test_a_dry_run_names_a_checkpoint_not_there_yet_when_it_needs_the_models_size(tmp_path, capsys):
    absent = tmp_path / "no_such_dir"
    err = parse_error([*REQUIRED, "--dry-run", "--hf-checkpoint", str(absent)], capsys)
    assert f"--hf-checkpoint {absent} does not exist: relax reads the Megatron model size from its config.json; " in err
    assert "fix the path, or give --num-layers, --hidden-size, --num-attention-heads to dry-run without the model" in (
        err
    )
    # A preset checked before its model is there: the flags give the size, the inputs are reported as not checked.
    assert parse_train_args([*RUN, "--hf-checkpoint", str(absent)]).run.hf_checkpoint == str(absent)
    # A run needs it there whatever the flags give.
    run_error = parse_error([*REQUIRED, *SIZE, "--hf-checkpoint", str(absent)], capsys)
    assert f"--hf-checkpoint {absent} does not exist" in run_error


def _not_a_directory(tmp_path: Path) -> Path:
    (tmp_path / "model.safetensors").write_text("")
    return tmp_path / "model.safetensors"


def _no_config(tmp_path: Path) -> Path:
    return tmp_path


def _config_not_json(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{model_type: qwen3")
    return tmp_path


def _config_not_an_object(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("[]")
    return tmp_path


@pytest.mark.parametrize(
    "make, message",
    [
        (_not_a_directory, "--hf-checkpoint {path} is not a directory (expected an HF model directory)"),
        (_no_config, "--hf-checkpoint {path}: no config.json there (expected an HF model directory)"),
        (_config_not_json, "--hf-checkpoint: {path}/config.json is not valid JSON ("),
        (_config_not_an_object, "--hf-checkpoint: {path}/config.json holds a JSON list, not an object"),
    ],
    ids=["not a directory", "no config.json", "not JSON", "not an object"],
)
@pytest.mark.parametrize("given_size", [[], SIZE], ids=["size unknown", "size given"])
@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry run", "run"])
def test_a_checkpoint_that_is_there_but_unreadable_is_named_first(tmp_path, capsys, make, message, given_size, dry_run):
    path = make(tmp_path)
    err = parse_error([*REQUIRED, *dry_run, *given_size, "--hf-checkpoint", str(path)], capsys)
    assert message.format(path=path) in err and "model size is unknown" not in err


def test_the_tiny_script_runs_a_given_model_of_its_family_and_refuses_one_of_another(tiny_exp_dir):
    env = {**os.environ, "EXP_DIR": str(tiny_exp_dir / "elsewhere"), "RELAX_PYTHON": str(tiny_exp_dir / "python"),
           "TINY_MODEL_DIR": str(tiny_exp_dir / "model")}
    env.pop("RELAX_DRY_RUN", None)
    printed = subprocess.run(["bash", str(TINY_SCRIPT)], env=env, capture_output=True, text=True, check=True).stdout
    assert "relax.tools.tiny_model" not in printed  # not built again
    assert f"--hf-checkpoint\n{tiny_exp_dir / 'model'}\n" in printed
    refused = subprocess.run(["bash", str(TINY_SCRIPT), "--tiny-model", "qwen3_5"], env=env, capture_output=True,
                             text=True)
    assert refused.returncode == 2 and not refused.stdout
    assert f"TINY_MODEL_DIR={tiny_exp_dir / 'model'} holds no tiny qwen3_5 model" in refused.stderr


def test_resolved_defaults():
    config = parse_train_args(RUN)
    assert config.algorithm.global_batch_size == 32 * 8  # one optimizer step per rollout
    assert config.actor.loss.clip_high == config.actor.loss.clip_low
    assert config.actor.lr_decay_steps == config.megatron.scheduler.lr_decay_iters == config.run.num_steps


def test_gspo_alone_is_gspo_as_published():
    loss = parse_train_args([*RUN, "--advantage-estimator", "gspo"]).actor.loss
    assert (loss.clip_low, loss.clip_high, loss.aggregation) == (3e-4, 4e-4, "seq_mean_token_mean")
    assert loss.ratio_level == "sequence"
    given = ["--eps-clip", "1e-3", "--loss-aggregation", "token-mean"]
    loss = parse_train_args([*RUN, "--advantage-estimator", "gspo", *given]).actor.loss
    assert (loss.clip_low, loss.clip_high, loss.aggregation) == (1e-3, 1e-3, "token_mean")
    config = parse_train_args([*RUN, "--eps-clip-high", "0.28"])
    loss = config.actor.loss
    assert (loss.clip_low, loss.clip_high, loss.aggregation, loss.ratio_level) == (0.2, 0.28, "token_mean", "token")
    assert (loss.dual_clip, loss.log_ratio_clamp, config.flags.k3_clamp) == (3.0, 20.0, None)


def test_overlong_penalty_factor_defaults_with_the_buffer():
    argv = [*RUN, "--rollout-max-response-len", "8", "--overlong-buffer-len", "4"]
    assert parse_train_args(argv).rollout.overlong_penalty_factor == 1.0
    assert parse_train_args([*argv, "--overlong-penalty-factor", "0.5"]).rollout.overlong_penalty_factor == 0.5


def test_reward_timeout_is_bounded_by_default_and_none_lifts_it(capsys):
    assert parse_train_args(RUN).rollout.reward_timeout == 60.0
    assert parse_train_args([*RUN, "--reward-timeout", "2.5"]).rollout.reward_timeout == 2.5
    assert parse_train_args([*RUN, "--reward-timeout", "none"]).rollout.reward_timeout is None
    assert "--reward-timeout: must be > 0, got 0" in parse_error([*RUN, "--reward-timeout", "0"], capsys)


def test_engine_restarts_and_the_driver_waits_are_bounded_by_default(capsys):
    run = parse_train_args(RUN).run
    assert run.max_engine_restarts == 3
    assert run.engine_start_timeout == Timeout(3600.0, "--engine-start-timeout")
    assert run.rollout_timeout == Timeout(4 * 3600.0, "--rollout-timeout")
    assert run.weight_sync_timeout == Timeout(3600.0, "--weight-sync-timeout")
    assert run.train_timeout == Timeout(4 * 3600.0, "--train-timeout")
    run = parse_train_args([*RUN, "--max-engine-restarts", "0", "--rollout-timeout", "none"]).run
    assert run.max_engine_restarts == 0 and run.rollout_timeout.seconds is None
    assert "--max-engine-restarts: must be >= 0, got -1" in parse_error([*RUN, "--max-engine-restarts", "-1"], capsys)
    assert "--weight-sync-timeout: must be > 0, got 0" in parse_error([*RUN, "--weight-sync-timeout", "0"], capsys)
    assert "--train-timeout: must be > 0, got 0" in parse_error([*RUN, "--train-timeout", "0"], capsys)


def test_engines_apart_take_devices_of_their_own_without_sleep_or_memory_saver_and_restart_engines_as_colocated():
    argv = [*RUN, "--num-devices-per-node", "2", "--no-colocate", "--rollout-num-gpus", "4"]
    config = parse_train_args([*argv, "--rollout-num-gpus-per-engine", "2"])
    assert (config.run.colocate, config.run.rollout_num_devices, config.run.max_engine_restarts) == (False, 4, 3)
    assert not config.sglang.enable_memory_saver and not config.actor.memory_saver
    assert config.rollout.devices_per_engine == 2
    # engines restarted in place as colocated (relax.run.loop_async), as many times as asked
    assert parse_train_args([*argv, "--max-engine-restarts", "1"]).run.max_engine_restarts == 1
    colocated = parse_train_args([*RUN, "--num-devices-per-node", "2"])
    assert (colocated.run.colocate, colocated.run.rollout_num_devices) == (True, None)


def test_engines_beside_the_actor_share_its_devices_without_sleep_or_memory_saver(capsys):
    argv = [*RUN, "--num-devices-per-node", "2", "--no-colocate", "--rollout-num-gpus", "0"]
    config = parse_train_args(argv)
    assert (config.run.colocate, config.run.rollout_num_devices, config.run.max_engine_restarts) == (False, 0, 3)
    assert not config.sglang.enable_memory_saver and not config.actor.memory_saver
    # the engines fill the actor's devices, as colocated
    assert "does not divide the 2 devices" in parse_error([*argv, "--rollout-num-gpus-per-engine", "4"], capsys)


def test_max_restarts_defaults_to_none_and_is_positive(capsys):
    assert parse_train_args(RUN).run.max_restarts == 0
    assert parse_train_args([*RUN, "--save", "checkpoints", "--max-restarts", "3"]).run.max_restarts == 3
    assert "--max-restarts: must be a positive integer, got 0" in parse_error(
        [*RUN, "--save", "checkpoints", "--max-restarts", "0"], capsys
    )


def test_gdn_training_kernel_defaults_to_the_devices_and_can_be_chosen():
    assert parse_train_args(RUN).actor.gdn_training_kernel == platform_facts("cpu").gdn_training_kernel == "reference"
    cuda = [arg if arg != "cpu" else "cuda" for arg in RUN]
    assert parse_train_args(cuda).actor.gdn_training_kernel == "relax"
    assert parse_train_args([*cuda, "--gdn-training-kernel", "reference"]).actor.gdn_training_kernel == "reference"
    npu = [arg if arg != "cpu" else "npu" for arg in RUN]
    assert parse_train_args(npu).actor.gdn_training_kernel == "mindspeed"


def test_colocation_needs_a_memory_saver_where_memory_must_be_released():
    config = parse_train_args(RUN)
    # A test double for a platform that must release memory to colocate but has no memory saver.
    without_saver = SimpleNamespace(name="gpu-without-saver", has_memory_saver=False, colocation_needs_release=True)
    assert (
        "--colocate on gpu-without-saver needs the rollout engine to release its memory"
        in colocation_releases_memory(config, without_saver)
    )
    for name in ("cpu", "cuda", "npu"):  # the real records all allow colocation
        assert colocation_releases_memory(config, platform_facts(name)) is None
    not_colocated = Parsed(argparse.Namespace(**{**vars(config.flags), "colocate": False}), config.megatron,
                           config.sglang)
    assert colocation_releases_memory(not_colocated, without_saver) is None


@pytest.mark.parametrize(
    "bad",
    [
        ["--reward-fn", "mod:"],
        ["--reward-fn", "no spaces"],
        ["--rollout-batch-size", "0"],
        ["--tis-clip", "0"],
        ["--rollout-rs-threshold", "2_0.5"],  # LOW_HIGH reversed
        ["--rollout-rs-threshold", "1.2_1.5"],  # keeps no sequence whose ratio is 1
        ["--rollout-rs-threshold", "abc"],
    ],
)
def test_bad_values_exit_2(bad, capsys):
    assert "error: argument" in parse_error([*RUN, *bad], capsys)


def test_rollout_rs_threshold_alone_is_symmetric_around_1():
    config = parse_train_args([*RUN, "--rollout-rs", "seq_mean_k1", "--rollout-rs-threshold", "2"])
    assert config.actor.rollout_correction.mis_bounds == (0.5, 2.0)


@pytest.mark.parametrize(
    "value, message",
    [("{enable_thinking: false}", "is not JSON (Expecting property name"), ("[false]", "is not a JSON object")],
)
def test_chat_template_kwargs_are_a_json_object_at_parse_time(value, message, capsys):
    argv = [*RUN, "--apply-chat-template", "--apply-chat-template-kwargs", value]
    assert f"argument --apply-chat-template-kwargs: {value!r} {message}" in parse_error(argv, capsys)
    config = parse_train_args([*argv[:-1], '{"enable_thinking": false}'])
    assert config.rollout.data.chat_template_kwargs == {"enable_thinking": False}


def test_bad_relax_device_environment_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("RELAX_DEVICE", "tpu")
    argv = ["--lr", "1e-6", "--prompt-data", "p", "--reward-fn", "math", "--dry-run", *SIZE]  # --device auto
    assert "unknown RELAX_DEVICE='tpu'" in parse_error(argv, capsys)


def test_fused_rmsnorm_is_refused_where_it_cannot_reach_the_norms(tmp_path, capsys):
    from relax.tools.tiny_model import build_tiny_model

    hf_dir = build_tiny_model(tmp_path / "qwen3_5", "qwen3_5")
    argv = ["--lr", "1e-6", "--prompt-data", "p.jsonl", "--reward-fn", "math", "--device", "npu", "--dry-run",
            "--hf-checkpoint", str(hf_dir), "--use-fused-rmsnorm"]
    assert "--use-fused-rmsnorm does not reach hybrid GDN models" in parse_error(argv, capsys)


def test_a_gdn_training_kernel_that_does_not_import_here_is_refused(tmp_path, capsys):
    from relax.tools.tiny_model import build_tiny_model

    hf_dir = build_tiny_model(tmp_path / "qwen3_5", "qwen3_5")
    argv = ["--lr", "1e-6", "--prompt-data", "p.jsonl", "--reward-fn", "math", "--device", "cpu", "--dry-run",
            "--hf-checkpoint", str(hf_dir), "--bf16", "--gdn-training-kernel"]
    assert "--gdn-training-kernel fla needs flash-linear-attention" in parse_error([*argv, "fla"], capsys)
    # MindSpeed is in the NPU image only: the refusal names the package and that image
    error = parse_error([*argv, "mindspeed"], capsys)
    assert "--gdn-training-kernel mindspeed needs MindSpeed (github.com/Ascend/MindSpeed" in error
    assert "docker/Dockerfile.npu" in error


def test_the_mindspeed_gdn_kernel_needs_half_precision(tmp_path, capsys):
    from relax.tools.tiny_model import build_tiny_model

    hf_dir = build_tiny_model(tmp_path / "qwen3_5", "qwen3_5")
    argv = ["--lr", "1e-6", "--prompt-data", "p.jsonl", "--reward-fn", "math", "--device", "npu", "--dry-run",
            "--hf-checkpoint", str(hf_dir)]
    assert "--gdn-training-kernel mindspeed does not take float32" in parse_error(argv, capsys)
    assert parse_train_args([*argv, "--bf16"]).actor.gdn_training_kernel == "mindspeed"
    assert parse_train_args([*argv, "--gdn-training-kernel", "reference"]).actor.gdn_training_kernel == "reference"


def test_recompute_flags_that_act_on_the_model_pass():
    moe = [*RUN, "--num-experts", "4", "--moe-shared-expert-intermediate-size", "32", "--recompute-activations"]
    tc = parse_train_args([*moe, "--recompute-modules", "core_attn", "moe", "shared_experts"]).megatron.transformer
    assert tc.recompute_granularity == "selective" and tc.recompute_modules == ["core_attn", "moe", "shared_experts"]
    dense = parse_train_args([*RUN, "--recompute-activations", "--recompute-modules", "mlp"]).megatron.transformer
    assert dense.recompute_modules == ["mlp"]
    full = [*RUN, "--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    assert parse_train_args(full).megatron.transformer.recompute_method == "block"


def test_the_relax_gdn_kernel_needs_the_interpreter_on_cpu(tmp_path, capsys):
    from relax.tools.tiny_model import build_tiny_model

    hf_dir = build_tiny_model(tmp_path / "qwen3_5", "qwen3_5")
    argv = ["--lr", "1e-6", "--prompt-data", "p.jsonl", "--reward-fn", "math", "--dry-run",
            "--hf-checkpoint", str(hf_dir)]
    error = parse_error([*argv, "--device", "cpu", "--gdn-training-kernel", "relax"], capsys)
    assert "--gdn-training-kernel relax runs Triton kernels, which on the cpu run only interpreted" in error
    assert "TRITON_INTERPRET=1" in error
