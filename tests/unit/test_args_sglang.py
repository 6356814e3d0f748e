"""--sglang-* flags: the ServerArgs relax builds equals the one SGLang builds from the same flags unprefixed."""

import argparse
import logging

import msgspec
import pytest

from helpers import REQUIRED, TINY_SIZE, parse_error
from relax.args import build_parser, parse_train_args
from relax.args.sglang import MANAGED_BY_RELAX, prepare_import, sglang_actions
from relax.args.unsupported import refused_sglang_field
from relax.platform import get_platform
from relax.rollout.engine_fields import server_defaults

# Enough for a run that only the SGLang flags vary in: a tiny model size, data, reward, LR, CPU.
BASE = [*TINY_SIZE, *REQUIRED]


@pytest.fixture
def checkpoint(tiny_qwen3):
    """A tiny Qwen3 checkpoint of BASE's size, as a command line names it."""
    return str(tiny_qwen3)


def relax_defaults_as_sglang_flags() -> list[str]:
    """relax's CPU defaults (relax.rollout.engine_fields.server_defaults) spelt as SGLang flags: given before the
    user's, SGLang's own parse takes them where the user gives nothing, as relax does."""
    flags = []
    by_dest = {action.dest: action for action in sglang_actions()}
    for dest, value in server_defaults(get_platform("cpu")).items():
        if dest in MANAGED_BY_RELAX:
            continue
        flag = by_dest[dest].option_strings[0]
        if value is True:
            flags.append(flag)
        else:
            assert value is not False, dest  # (no default turns a flag off today)
            flags += [flag, str(value)]
    return flags


@pytest.fixture
def sglang_own_parse():
    """SGLang's own path, prepare_server_args: its parser, its --config merger, its from_cli_args.
    It reconfigures root logging (basicConfig(force=True)); put it back afterwards."""
    prepare_import("cpu")  # as relax does before SGLang is first imported in a process
    from sglang.srt.server_args import prepare_server_args

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield prepare_server_args
    root.handlers[:] = handlers
    root.setLevel(level)


def assert_same_server_args(ours, theirs):
    assert type(ours) is type(theirs)
    names = [f.name for f in msgspec.structs.fields(type(theirs))]
    assert len(names) > 500  # every field is compared, not a sample
    differing = {n: (getattr(ours, n), getattr(theirs, n)) for n in names if getattr(ours, n) != getattr(theirs, n)}
    assert differing == {}


# (SGLang's own spelling, relax's spelling): every kind of action SGLang registers.
CASES = {
    "store_true": (["--enable-hierarchical-cache"], ["--sglang-enable-hierarchical-cache"]),
    "store_true alias": (["--enable-hicache"], ["--sglang-enable-hicache"]),
    "boolean optional, negative": (["--no-enable-tf32-matmul"], ["--no-sglang-enable-tf32-matmul"]),
    "boolean optional, positive": (["--enable-fused-qk-norm-rope"], ["--sglang-enable-fused-qk-norm-rope"]),
    "valued aliases": (
        ["--moe-data-parallel-size", "2", "--ep", "2", "--attention-data-parallel-size", "2"],
        ["--sglang-moe-data-parallel-size", "2", "--sglang-ep", "2", "--sglang-attention-data-parallel-size", "2"],
    ),
    "dest differs from flag": (
        ["--fp8-gemm-backend", "triton", "--elastic-ep-join-mode", "scale"],
        ["--sglang-fp8-gemm-backend", "triton", "--sglang-elastic-ep-join-mode", "scale"],
    ),
    "lists": (
        [
            "--cuda-graph-bs-decode",
            "1",
            "2",
            "4",
            "--log-requests-target",
            "stdout",
            "stderr",
            "--gc-threshold",
            "10",
            "5",
        ],
        ["--sglang-cuda-graph-bs-decode", "1", "2", "4", "--sglang-log-requests-target", "stdout", "stderr"]
        + ["--sglang-gc-threshold", "10", "5"],
    ),
    "choices and types": (
        [
            "--attention-backend",
            "torch_native",
            "--dtype",
            "float32",
            "--mem-fraction-static",
            "0.05",
            "--max-running-requests",
            "8",
        ],
        ["--sglang-attention-backend", "torch_native", "--sglang-dtype", "float32"]
        + ["--sglang-mem-fraction-static", "0.05", "--sglang-max-running-requests", "8"],
    ),
    "explicitly-set bookkeeping": (["--radix-eviction-policy", "lru"], ["--sglang-radix-eviction-policy=lru"]),
    "deprecated actions": (
        ["--disable-cuda-graph", "--monokernel-backend", "amd"],
        ["--sglang-disable-cuda-graph", "--sglang-monokernel-backend", "amd"],
    ),
    "nothing given": ([], []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_prefixed_flags_build_the_server_args_sglang_builds(case, checkpoint, sglang_own_parse):
    theirs_argv, ours_argv = CASES[case]
    theirs = sglang_own_parse(
        ["--model-path", checkpoint, "--device", "cpu", *relax_defaults_as_sglang_flags(), *theirs_argv]
    )
    ours = parse_train_args([*BASE, "--hf-checkpoint", checkpoint, *ours_argv]).sglang
    assert_same_server_args(ours, theirs)


def test_a_given_flag_wins_over_relaxs_default_even_at_sglangs_default(checkpoint):
    """The dry run shows what the engine runs with: relax's CPU defaults where nothing is given, and the user's
    value where it is, also one equal to SGLang's own default (log_level's "info")."""
    defaults = parse_train_args([*BASE, "--hf-checkpoint", checkpoint]).sglang
    assert (defaults.log_level, defaults.attention_backend, defaults.mem_fraction_static) == (
        "warning", "torch_native", 0.25
    )
    given = parse_train_args([*BASE, "--hf-checkpoint", checkpoint, "--sglang-log-level", "info"]).sglang
    assert given.log_level == "info"


def test_engine_logs_has_sglang_log_its_batches_unless_a_level_is_given(checkpoint):
    config = parse_train_args([*BASE, "--hf-checkpoint", checkpoint, "--engine-logs"])
    assert config.sglang.log_level == "info" and config.outputs.engine_logs
    argv = [*BASE, "--hf-checkpoint", checkpoint, "--engine-logs", "--sglang-log-level", "debug"]
    assert parse_train_args(argv).sglang.log_level == "debug"
    assert not parse_train_args([*BASE, "--hf-checkpoint", checkpoint]).outputs.engine_logs


def test_sglang_config_file_means_what_it_means_to_sglang(tmp_path, checkpoint, sglang_own_parse):
    config = tmp_path / "engine.yaml"
    config.write_text(
        "mem-fraction-static: 0.1\nenable-hierarchical-cache: true\ndisable-radix-cache: false\n"
        "cuda-graph-bs-decode: [1, 2]\nattention-backend: torch_native\nradix-eviction-policy: lfu\n"
    )
    override = ["--mem-fraction-static", "0.2"]  # the command line wins over the file
    theirs = sglang_own_parse(
        ["--model-path", checkpoint, "--device", "cpu", *relax_defaults_as_sglang_flags(), "--config", str(config),
         *override]
    )
    ours = parse_train_args(
        [*BASE, "--hf-checkpoint", checkpoint, "--sglang-config", str(config), "--sglang-mem-fraction-static", "0.2"]
    )
    assert ours.sglang.mem_fraction_static == 0.2 and ours.sglang.enable_hierarchical_cache
    assert_same_server_args(ours.sglang, theirs)


def test_every_sglang_flag_is_registered_with_the_prefix():
    ours = {o for a in build_parser()._actions for o in a.option_strings if "sglang-" in o}
    theirs = [o for a in sglang_actions() for o in a.option_strings]
    assert len(theirs) > 500
    expected = {"--sglang-config"} | {
        f"--no-sglang-{o[5:]}" if o.startswith("--no-") else f"--sglang-{o[2:]}" for o in theirs
    }
    assert ours == expected


def test_relax_fills_the_fields_it_manages(checkpoint):
    config = parse_train_args([*BASE, "--hf-checkpoint", checkpoint, "--rollout-num-devices-per-engine", "1"])
    assert (config.sglang.model_path, config.sglang.tp_size, config.sglang.device) == (checkpoint, 1, "cpu")
    assert config.sglang.enable_memory_saver is False  # the CPU has no memory saver
    gpu = ["--device", "cuda", "--dry-run", "--num-devices-per-node", "2", "--rollout-num-devices-per-engine", "2"]
    assert parse_train_args([*BASE, *gpu]).sglang.enable_memory_saver is True
    assert parse_train_args([*BASE, *gpu]).sglang.tp_size == 2


@pytest.mark.parametrize(
    "flag, relax_flag",
    [
        (["--sglang-model-path", "/m"], "--hf-checkpoint"),
        (["--sglang-model=/m"], "--hf-checkpoint"),
        (["--sglang-tokenizer-path", "/m"], "--hf-checkpoint"),
        (["--sglang-tp-size", "2"], "--rollout-num-devices-per-engine"),
        (["--sglang-tensor-parallel-size", "2"], "--rollout-num-devices-per-engine"),
        (["--sglang-port", "30000"], "placement"),
        (["--sglang-nccl-port", "30001"], "placement"),
        (["--sglang-dist-init-addr", "h:1"], "placement"),
        (["--sglang-base-gpu-id", "1"], "placement"),
        (["--sglang-enable-memory-saver"], "--colocate"),
        (["--sglang-device", "cuda"], "--device"),
        (["--sglang-default-chat-template-kwargs", '{"enable_thinking": false}'], "--apply-chat-template-kwargs"),
    ],
)
def test_managed_fields_are_refused_naming_the_relax_flag(flag, relax_flag, capsys):
    err = parse_error([*BASE, *flag], capsys)
    assert "set by relax" in err and relax_flag in err


def test_every_managed_field_is_refused():
    parser = build_parser()
    refused = {
        a.dest[len("sglang_") :]
        for a in parser._actions
        if type(a).__name__ == "RefusedFlag" and a.dest.startswith("sglang_")
    }
    refused_by_table = {a.dest for a in sglang_actions() if refused_sglang_field(a.dest)}
    assert refused == set(MANAGED_BY_RELAX) | refused_by_table


def test_managed_field_in_the_config_file_is_refused(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("tp-size: 2\n")
    err = parse_error([*BASE, "--sglang-config", str(config)], capsys)
    assert "'tp-size' is set by relax" in err and "--rollout-num-devices-per-engine" in err


def test_unknown_key_in_the_config_file_is_refused_with_a_guess(tmp_path, capsys):
    config = tmp_path / "engine.yaml"
    config.write_text("mem_fraction_static: 0.1\n")
    err = parse_error([*BASE, "--sglang-config", str(config)], capsys)
    assert "unknown SGLang flag 'mem_fraction_static'" in err and "mem-fraction-static" in err


@pytest.mark.parametrize(
    "flag, suggestion",
    [
        ("--mamba-radix-cache-strategy", "--sglang-mamba-radix-cache-strategy"),
        # The name in newer SGLang releases; the installed 0.5.23 calls it --mamba-radix-cache-strategy.
        ("--mamba-scheduler-strategy", "--sglang-mamba-radix-cache-strategy"),
        ("--no-enable-tf32-matmul", "--no-sglang-enable-tf32-matmul"),
        ("--sglang-mem-fraction-statc", "--sglang-mem-fraction-static"),
        ("--sglang-mamba-scheduler-strategy", "--sglang-mamba-radix-cache-strategy"),  # prefixed, other name
    ],
)
def test_unprefixed_or_misspelt_sglang_flag_suggests_the_prefixed_one(flag, suggestion, capsys):
    err = parse_error([*BASE, flag, "x"], capsys)
    assert f"unknown flag {flag}: did you mean {suggestion}" in err


def test_unprefixed_managed_flag_names_the_relax_flag(capsys):
    assert "unknown flag --tp-size: use --rollout-num-devices-per-engine" in parse_error(
        [*BASE, "--tp-size", "2"], capsys
    )


def test_no_abbreviations(capsys):
    assert "unknown flag --sglang-mem-fraction" in parse_error([*BASE, "--sglang-mem-fraction", "0.1"], capsys)


def test_a_stray_value_is_an_error(capsys):
    assert "unexpected value" in parse_error([*BASE, "stray"], capsys)


def test_help_lists_the_namespaces():
    text = build_parser().format_help()
    assert (
        "SGLang engine" in text and "--sglang-mem-fraction-static" in text and "--no-sglang-enable-tf32-matmul" in text
    )
    assert "Megatron (megatron-core TransformerConfig" in text and "--tensor-model-parallel-size" in text
    assert "relax: rollout" in text
    assert isinstance(build_parser(), argparse.ArgumentParser)


def test_parsing_prepares_sglang_before_importing_it():
    import os
    import sys

    from relax.platform import get_platform

    parse_train_args([*BASE, "--dry-run"])
    assert "sglang" in sys.modules and os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"
    get_platform("cpu").prepare_sglang()  # raises if sglang had been imported unprepared


# A run on a device with decode graphs (CUDA, Ascend NPU graph mode), parsed without its device (--dry-run).
GRAPH_RUN = [*TINY_SIZE, "--lr", "1e-6", "--prompt-data", "prompts.jsonl", "--reward-fn", "math", "--dry-run"]


def decode_graph_sizes(device: str, *flags: str) -> tuple:
    """The engines' ServerArgs (cuda_graph_max_bs_decode, cuda_graph_bs_decode) for a --dry-run on `device`."""
    sglang = parse_train_args([*GRAPH_RUN, "--device", device, *flags]).sglang
    return sglang.cuda_graph_max_bs_decode, sglang.cuda_graph_bs_decode


@pytest.mark.parametrize("device", ["cuda", "npu"])
@pytest.mark.parametrize(
    "flags, largest",
    [
        (["--rollout-batch-size", "64", "--n-samples-per-prompt", "8", "--num-devices-per-node", "2"], 256),
        (["--rollout-batch-size", "128", "--n-samples-per-prompt", "8"], 1024),
        # 5 prompts over 2 engines: 3 and 2
        (["--rollout-batch-size", "5", "--n-samples-per-prompt", "8", "--num-devices-per-node", "2"], 24),
        # --over-sampling-batch-size prompts in flight, with or without dynamic sampling
        (["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-devices-per-node", "2",
          "--dynamic-sampling", "--over-sampling-batch-size", "64"], 256),
        (["--rollout-batch-size", "32", "--n-samples-per-prompt", "8", "--num-devices-per-node", "2",
          "--over-sampling-batch-size", "64"], 256),
        # 4 engines of 8 devices on 2 nodes of 16, as the 35B NPU preset places them
        (["--rollout-batch-size", "64", "--n-samples-per-prompt", "8", "--num-nodes", "2",
          "--num-devices-per-node", "16", "--rollout-num-devices-per-engine", "8"], 128),
    ],
    ids=["64x8 over 2 engines", "128x8 over 1", "uneven split", "dynamic sampling", "over-sampling",
         "35B NPU placement"],
)
def test_decode_graphs_cover_the_most_requests_an_engine_runs_at_once(device, flags, largest):
    assert decode_graph_sizes(device, *flags) == (largest, None)


def test_decode_graphs_stop_at_the_engines_max_running_requests():
    batch = ["--rollout-batch-size", "128", "--n-samples-per-prompt", "8"]
    assert decode_graph_sizes("cuda", *batch, "--sglang-max-running-requests", "300") == (300, None)
    assert decode_graph_sizes("cuda", *batch, "--sglang-max-running-requests", "2048") == (1024, None)


@pytest.mark.parametrize(
    "given, sizes",
    [
        (["--sglang-cuda-graph-max-bs-decode", "64"], (64, None)),
        (["--sglang-cuda-graph-bs-decode", "1", "2", "4"], (None, [1, 2, 4])),  # SGLang's largest is then 4
        (["--sglang-cuda-graph-config", '{"decode": {"max_bs": 48}}'], (None, None)),  # SGLang's JSON wins
    ],
)
def test_the_users_decode_graph_sizes_are_kept(given, sizes):
    batch = ["--rollout-batch-size", "128", "--n-samples-per-prompt", "8"]
    assert decode_graph_sizes("cuda", *batch, *given) == sizes


def test_the_cpu_runs_no_decode_graphs_and_gets_no_graph_sizes():
    sglang = parse_train_args([*BASE, "--dry-run", "--rollout-batch-size", "128", "--n-samples-per-prompt", "8"]).sglang
    assert sglang.disable_cuda_graph
    assert (sglang.cuda_graph_max_bs_decode, sglang.cuda_graph_bs_decode) == (None, None)
