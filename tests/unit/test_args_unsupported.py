"""The table of unsupported settings is enforced at parse time: what --dry-run accepts, a run carries out."""

import pytest

from relax.args import parse_train_args
from relax.args.checks import RULES
from relax.args.unsupported import REFUSED_FLAGS, UNSUPPORTED_COMBINATIONS, unsupported_combinations

SIZE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
RUN = ["--lr", "1e-6", "--prompt-data", "prompts.jsonl", "--reward-fn", "math", "--device", "cpu", "--dry-run", *SIZE]
COMBINATIONS = {
    "--no-colocate": ["--no-colocate"],
    "--save / --load with --debug-rollout-only": ["--debug-rollout-only", "--save", "ckpt"],
    "--log-interval other than 1": ["--log-interval", "2"],
    "--context-parallel-size other than 1": ["--context-parallel-size", "2"],
    "--recompute-modules moe_act with --moe-grouped-gemm": [
        "--num-experts", "4", "--moe-grouped-gemm", "--recompute-activations", "--recompute-modules", "moe_act",
    ],
    "--advantage-estimator dapo": ["--advantage-estimator", "dapo"],
}


def parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_train_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("entry", UNSUPPORTED_COMBINATIONS, ids=lambda entry: entry.setting)
def test_each_unsupported_combination_is_refused_at_parse_time_with_what_to_do(entry, capsys):
    error = parse_error([*RUN, *COMBINATIONS[entry.setting]], capsys)
    assert "is not supported: " + entry.reason in error and entry.instead in error


def test_every_unsupported_combination_found_is_named_at_once(capsys):
    error = parse_error([*RUN, "--no-colocate", "--log-interval", "3", "--context-parallel-size", "2"], capsys)
    assert "--no-colocate is not supported" in error and "--log-interval 3 is not supported" in error
    assert "--context-parallel-size 2 is not supported" in error


@pytest.mark.parametrize("entry", REFUSED_FLAGS, ids=lambda entry: entry.setting)
def test_each_refused_flag_is_refused_with_what_to_do(entry, capsys):
    error = parse_error([*RUN, entry.setting, "1"], capsys)
    assert f"{entry.setting} is not supported: {entry.reason}" in error and entry.instead in error


def test_the_table_is_one_of_the_parse_time_rules():
    assert unsupported_combinations in RULES


def test_a_setting_that_refuses_its_value_is_a_parse_error(capsys):
    assert "top_p=2.0 (must be in (0, 1])" in parse_error([*RUN, "--rollout-top-p", "2"], capsys)
