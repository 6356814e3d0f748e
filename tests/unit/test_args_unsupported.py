"""The table of unsupported settings is enforced at parse time (what --dry-run accepts, a run carries out), and
every flag of the parser has a reader: a settings builder, a parse-time rule, a megatron-core config object, or
the table's refusal."""

import pytest

from helpers import DRY_RUN as RUN, REQUIRED, parse_error
from relax.args import build_parser, parse_train_args
from relax.args.checks import RULES, check_config
from relax.args.megatron import MODEL_FLAGS, SCHEDULER_FLAGS, checkpoint_architecture, field_flags
from relax.args.settings import (
    actor_settings, algorithm_settings, eval_settings, output_settings, rollout_settings, run_settings,
)
from relax.args.unsupported import (
    LORA, REFUSED_FLAGS, REFUSED_SGLANG_FIELDS, REFUSED_VALUES, SERVER_ONLY, SERVER_ONLY_FIELDS,
    SPECULATIVE, UNSUPPORTED_COMBINATIONS, refused_sglang_field, unsupported_combinations,
)
from relax.hf_checkpoint import read_hf_checkpoint
from relax.tools.tiny_model import build_tiny_model
from relax.run.metrics import METRICS_FILE
from relax.platform import platform_facts

# Every switch that makes a builder read more flags, on at once (a consistent run).
EVERY_FEATURE = [
    "--use-wandb", "--use-kl-loss", "--kl-coef", "0.1", "--use-tis", "--rollout-rs", "seq_mean_k1",
    "--rollout-rs-threshold", "2", "--use-dynamic-batch-size", "--max-tokens-per-device", "64", "--dynamic-sampling",
    "--overlong-buffer-len", "8", "--apply-chat-template", "--system-prompt", "Be brief.",
    "--eval-prompt-data", "held_out", "h.jsonl", "--eval-interval", "2", "--eval-n-samples-per-prompt", "4",
    "--eval-temperature", "0.5", "--eval-top-p", "0.9", "--eval-max-response-len", "8", "--partial-rollout",
    "--max-staleness", "2", "--tools", "calculator", "--max-turns", "3",
]
# Flags whose only effect is at parse time, and why that is their whole job.
READ_AT_PARSE_TIME_ONLY = {
    "log_interval": "every step is logged: any other value is refused by the table",
    "device_memory_gib": "the device the layout's estimated training memory is checked against before the run",
}
# Model-level Megatron flags that config.json does not fix, and what reads them.
OTHER_MODEL_FLAG_READERS = {
    "swiglu": "sets TransformerConfig.gated_linear_unit and activation_func",
    "position_embedding_type": "the table refuses anything but rope",
}
COMBINATIONS = {
    "--save / --load with --debug-rollout-only": ["--debug-rollout-only", "--save", "ckpt"],
    "--log-interval other than 1": ["--log-interval", "2"],
    "--context-parallel-size above 1 with MoE router losses (--moe-aux-loss-coeff, --moe-z-loss-coeff above 0)": [
        "--context-parallel-size", "2", "--num-devices-per-node", "2", "--num-experts", "4",
        "--moe-aux-loss-coeff", "0.01",
    ],
    "--recompute-modules moe_act with --moe-grouped-gemm": [
        "--num-experts", "4", "--moe-grouped-gemm", "--recompute-activations", "--recompute-modules", "moe_act",
    ],
    "--mtp-num-layers": ["--mtp-num-layers", "1"],
    "--position-embedding-type other than rope": ["--position-embedding-type", "learned_absolute"],
    "--sglang-dp-size above 1": ["--sglang-dp-size", "2"],
}


@pytest.mark.parametrize("entry", UNSUPPORTED_COMBINATIONS, ids=lambda entry: entry.setting)
def test_each_unsupported_combination_is_refused_at_parse_time_with_what_to_do(entry, capsys):
    error = parse_error([*RUN, *COMBINATIONS[entry.setting]], capsys)
    assert "is not supported: " + entry.reason in error and entry.instead in error


def test_every_unsupported_combination_found_is_named_at_once(capsys):
    argv = [*RUN, "--sglang-dp-size", "2", "--log-interval", "3", "--context-parallel-size", "2", "--num-experts", "4"]
    error = parse_error([*argv, "--moe-z-loss-coeff", "0.001", "--num-devices-per-node", "2"], capsys)
    assert "--sglang-dp-size 2 is not supported" in error and "--log-interval 3 is not supported" in error
    assert "--context-parallel-size 2 with MoE router losses" in error


@pytest.mark.parametrize(
    "model", [[], ["--num-experts", "4", "--moe-aux-loss-coeff", "0"], ["--pipeline-model-parallel-size", "2"]],
    ids=["dense", "moe", "pipeline"],
)
def test_context_parallelism_of_a_softmax_attention_model_is_accepted(model):
    parsed = parse_train_args([*RUN, *model, "--context-parallel-size", "2", "--num-devices-per-node", "4"])
    assert parsed.megatron.transformer.context_parallel_size == 2


def test_context_parallelism_of_a_qwen35_checkpoint_is_accepted(tmp_path):
    """megatron-core's TransformerConfig asserts CP = 1 for Gated DeltaNet layers; relax's layers pass their state."""
    checkpoint = build_tiny_model(tmp_path, "qwen3_5")
    argv = [*REQUIRED, "--dry-run", "--hf-checkpoint", str(checkpoint), "--context-parallel-size", "2"]
    parsed = parse_train_args([*argv, "--num-devices-per-node", "2"])
    transformer = parsed.megatron.transformer
    assert transformer.context_parallel_size == 2 and transformer.experimental_attention_variant == "gated_delta_net"


@pytest.mark.parametrize("entry", REFUSED_FLAGS, ids=lambda entry: entry.setting)
def test_each_refused_flag_is_refused_with_what_to_do(entry, capsys):
    error = parse_error([*RUN, entry.setting, "1"], capsys)
    assert f"{entry.setting} is not supported: {entry.reason}" in error and entry.instead in error


@pytest.mark.parametrize("entry", REFUSED_VALUES, ids=lambda entry: entry.setting)
@pytest.mark.parametrize("spelling", ["separate", "joined"])
def test_each_refused_value_is_refused_with_what_to_do(entry, spelling, capsys):
    flag, value = entry.setting.split(" ")
    given = [flag, value] if spelling == "separate" else [f"{flag}={value}"]
    error = parse_error([*RUN, *given], capsys)
    assert f"{entry.setting} is not supported: {entry.reason}" in error and entry.instead in error


def test_the_table_is_one_of_the_parse_time_rules():
    assert unsupported_combinations in RULES


class ReadRecorder:
    """A namespace's values, noting each name read."""

    def __init__(self, namespace):
        self._namespace, self.read = namespace, set()

    def __getattr__(self, name):
        self.read.add(name)
        return getattr(self._namespace, name)


def _reads(argv) -> tuple[set, set, set]:
    """(relax flags the settings builders read, relax flags the parse-time rules read, LR-schedule flags read)."""
    config = parse_train_args(argv)
    built, checked, scheduler = (ReadRecorder(config.flags), ReadRecorder(config.flags),
                                 ReadRecorder(config.megatron.scheduler))
    for build in (run_settings, algorithm_settings, output_settings):
        build(built)
    eval_settings(built, rollout_settings(built, config.rollout.context).sampling)
    actor_settings(built, scheduler)
    assert check_config(checked, config.megatron, config.sglang, platform_facts("cpu")) == []
    return built.read, checked.read, scheduler.read


def test_every_flag_has_a_reader(tmp_path, pretend_wandb_installed, tiny_qwen3):
    pretend_wandb_installed(installed=True)  # --use-wandb is among the features read
    record = tmp_path / "record"
    record.mkdir()
    (record / METRICS_FILE).write_text("")  # an earlier run's record, which --overwrite-output-dir replaces
    parser = build_parser()
    relax_dests = {a.dest for a in parser._actions if not a.dest.startswith(("sglang_", "megatron_", "help"))}
    megatron_names = {a.dest.removeprefix("megatron_") for a in parser._actions if a.dest.startswith("megatron_")}
    built, checked, scheduler = set(), set(), set()
    apart = [*RUN, "--no-colocate", "--rollout-num-gpus", "1"]  # the engines on devices of their own
    everything = [*RUN, *EVERY_FEATURE, "--output-dir", str(record), "--overwrite-output-dir"]
    for argv in (RUN, apart, everything):
        for into, reads in zip((built, checked, scheduler), _reads(argv)):
            into |= reads

    assert relax_dests - built - checked == set()  # a relax flag nothing reads
    assert relax_dests - built == set(READ_AT_PARSE_TIME_ONLY)  # read only by a rule: its job must be that

    forms, _, _ = field_flags()  # megatron-core's dataclass fields: the config objects the actor builds
    # A model flag config.json fixes must agree with it (relax.args.megatron.resolve_architecture).
    fixed = set(checkpoint_architecture(read_hf_checkpoint(tiny_qwen3)))
    assert set(MODEL_FLAGS) - fixed - set(OTHER_MODEL_FLAG_READERS) == set()
    assert set(SCHEDULER_FLAGS) - scheduler == set()  # an LR-schedule flag the actor's settings do not take
    refused = {entry.setting.removeprefix("--").replace("-", "_") for entry in REFUSED_FLAGS}
    assert megatron_names - set(forms) - set(MODEL_FLAGS) - set(SCHEDULER_FLAGS) - refused == set()


def test_lr_warmup_fraction_and_init_reach_the_actor(capsys):
    actor = parse_train_args([*RUN, "--num-steps", "40", "--lr-warmup-fraction", "0.25", "--lr-warmup-init", "1e-8"]).actor
    assert (actor.lr_warmup_steps, actor.lr_warmup_init, actor.lr_decay_steps) == (10, 1e-8, 40)
    actor = parse_train_args([*RUN, "--lr-warmup-iters", "3", "--lr-decay-iters", "20"]).actor
    assert (actor.lr_warmup_steps, actor.lr_warmup_init, actor.lr_decay_steps) == (3, 0.0, 20)
    error = parse_error([*RUN, "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "3"], capsys)
    assert "both set the warmup's length: give one" in error


def test_a_setting_that_refuses_its_value_is_a_parse_error(capsys):
    assert "top_p=2.0 (must be in (0, 1])" in parse_error([*RUN, "--rollout-top-p", "2"], capsys)


def test_the_actor_sleeps_through_the_platforms_route_unless_told(capsys, monkeypatch):
    from relax.args.settings import actor_sleep_route

    assert not parse_train_args(RUN).actor.memory_saver  # the CPU's route: host copies
    flags = parse_train_args(RUN).flags
    for device, route in (("cuda", "host-copies"), ("npu", "memory-saver")):
        monkeypatch.setattr(flags, "device", device)
        assert actor_sleep_route(flags) == route
    monkeypatch.setattr(flags, "actor_sleep_route", "memory-saver")
    assert actor_sleep_route(flags) == "memory-saver"
    error = parse_error([*RUN, "--actor-sleep-route", "memory-saver"], capsys)
    assert "--actor-sleep-route memory-saver: the cpu platform has no memory saver; use host-copies" in error


def _refused_sglang_flags() -> list[tuple[str, object]]:
    """Each refused SGLang flag (every spelling, prefixed) with its table entry."""
    from relax.args.sglang import prefixed, sglang_actions

    parse_train_args(RUN)  # prepares SGLang's import for the CPU before its parser is read
    return [
        (prefixed(option), entry)
        for action in sglang_actions()
        if (entry := refused_sglang_field(action.dest))
        for option in action.option_strings
    ]


def test_every_speculative_and_multi_node_sglang_flag_is_refused():
    refused = {flag for flag, _ in _refused_sglang_flags()}
    assert {"--sglang-speculative-algorithm", "--sglang-speculative-draft-model-path", "--sglang-pp-size",
            "--sglang-pipeline-parallel-size", "--sglang-nnodes", "--sglang-node-rank",
            "--sglang-disaggregation-mode"} <= refused
    from relax.args.sglang import sglang_actions

    speculative = {a.dest for a in sglang_actions() if a.dest.startswith("speculative_")}
    assert len(speculative) > 10 and all(refused_sglang_field(dest) is SPECULATIVE for dest in speculative)
    assert set(REFUSED_SGLANG_FIELDS) <= {a.dest for a in sglang_actions()}  # each names a field SGLang has


def test_every_lora_and_server_only_sglang_flag_is_refused():
    from relax.args.sglang import sglang_actions

    refused = {flag: entry for flag, entry in _refused_sglang_flags()}
    for flag in ("--sglang-enable-lora", "--sglang-lora-paths", "--sglang-max-lora-rank"):
        assert refused[flag] is LORA, flag
    for flag in ("--sglang-api-key", "--sglang-grpc-port", "--sglang-grpc-mode", "--sglang-ssl-keyfile"):
        assert refused[flag] is SERVER_ONLY, flag
    dests = {a.dest for a in sglang_actions()}
    assert SERVER_ONLY_FIELDS <= dests  # each names a field SGLang has
    assert refused_sglang_field("host") is None  # the engine's bootstrap and data-parallel servers bind it


def test_data_parallel_sglang_copies_are_refused_but_data_parallel_attention_is_not(capsys):
    (entry,) = [e for e in UNSUPPORTED_COMBINATIONS if e.setting.startswith("--sglang-dp-size")]
    error = parse_error([*RUN, "--sglang-data-parallel-size", "2"], capsys)
    assert f"--sglang-dp-size 2 is not supported: {entry.reason}" in error
    # Data-parallel attention, and its deprecated spelling (SGLang turns it into --sglang-attn-dp-size 2).
    assert parse_train_args([*RUN, "--sglang-attn-dp-size", "2"]).sglang.attn_dp_size == 2
    assert parse_train_args([*RUN, "--sglang-dp-size", "2", "--sglang-enable-dp-attention"]).sglang.dp_size == 2


def test_each_refused_sglang_flag_is_refused_with_the_reason(capsys):
    for flag, entry in _refused_sglang_flags():
        error = parse_error([*RUN, flag, "1"], capsys)
        assert f"{flag} is not supported: {entry.reason}; {entry.instead}" in error, flag
    error = parse_error([*RUN, "--sglang-speculative-algorithm", "EAGLE"], capsys)
    assert "speculative decoding is not carried out: the weight push does not update a draft model" in error


def test_a_refused_sglang_field_in_the_config_file_is_refused(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("speculative-num-steps: 3\n")
    error = parse_error([*RUN, "--sglang-config", str(config)], capsys)
    assert f"'speculative-num-steps' is not supported: {SPECULATIVE.reason}" in error


def test_a_refused_sglang_field_keeps_sglangs_default():
    from relax.args.sglang import sglang_actions

    server_args = parse_train_args(RUN).sglang
    defaults = {a.dest: a.default for a in sglang_actions()}
    assert (server_args.pp_size, server_args.nnodes, server_args.speculative_algorithm) == (
        defaults["pp_size"], defaults["nnodes"], defaults["speculative_algorithm"]
    )
