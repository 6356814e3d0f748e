"""The evaluation flags: NAME PATH pairs, defaults from the rollout's sampling, what --eval-only refuses."""

import pytest

from helpers import DRY_RUN as RUN, TINY_SIZE as SIZE, parse_error
from relax.args import parse_train_args
from relax.args.settings import RunMode

EVAL = ["--eval-prompt-data", "held_out", "h.jsonl", "aime", "a.parquet"]


def test_eval_sets_read_as_the_prompt_data_and_sample_as_the_rollout():
    config = parse_train_args(
        [*RUN, *EVAL, "--input-key", "question", "--rollout-temperature", "0.7", "--rollout-max-response-len", "64"]
    )
    evaluation = config.evaluation
    assert list(evaluation.datasets) == ["held_out", "aime"]
    assert evaluation.datasets["aime"].path == "a.parquet" and evaluation.datasets["aime"].prompt_key == "question"
    assert evaluation.datasets["held_out"] == config.rollout.data.__class__(
        **{**vars(config.rollout.data), "path": "h.jsonl"}
    )
    sampling = evaluation.sampling
    assert (sampling.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (1, 0.7, 1.0, 64)
    assert evaluation.interval is None and config.run.mode is not RunMode.EVAL_ONLY


def test_eval_sampling_flags_override_the_rollouts():
    config = parse_train_args(
        [*RUN, *EVAL, "--eval-interval", "5", "--eval-n-samples-per-prompt", "8", "--eval-temperature", "0",
         "--eval-top-p", "0.9", "--eval-max-response-len", "3"]
    )
    sampling = config.evaluation.sampling
    assert (sampling.n, sampling.temperature, sampling.top_p, sampling.max_new_tokens) == (8, 0.0, 0.9, 3)
    assert config.evaluation.interval == 5


def test_no_eval_prompt_data_no_evaluation():
    assert parse_train_args(RUN).evaluation.datasets == {}


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eval-prompt-data", "h.jsonl"], "--eval-prompt-data takes NAME PATH pairs, got 1 values (h.jsonl)"),
        (["--eval-prompt-data", "a", "x.jsonl", "b"], "got 3 values"),
        (["--eval-prompt-data", "data/h.jsonl", "x.jsonl"], "'data/h.jsonl' is not a NAME"),
        (["--eval-prompt-data", "a", "x.jsonl", "a", "y.jsonl"], "--eval-prompt-data names a more than once"),
        (["--eval-interval", "5"], "--eval-interval without --eval-prompt-data NAME PATH ...: nothing to evaluate"),
        (["--eval-only", "--eval-temperature", "0"], "--eval-temperature, --eval-only without --eval-prompt-data"),
        ([*EVAL, "--eval-top-p", "1.5"], "top_p=1.5 (must be in (0, 1])"),
        ([*EVAL, "--debug-train-only", "--load-rollout-data", "d.jsonl"], "--debug-train-only does not start"),
    ],
)
def test_bad_eval_flags_are_refused_naming_them(args, message, capsys):
    assert message in parse_error([*RUN, *args], capsys)


EVAL_ONLY = ["--reward-fn", "math", "--device", "cpu", "--dry-run", *SIZE, *EVAL, "--eval-only"]


def test_eval_only_needs_no_training_data_or_learning_rate():
    config = parse_train_args(EVAL_ONLY)
    assert config.run.mode is RunMode.EVAL_ONLY and config.rollout.data is None


def test_eval_only_samples_through_a_custom_generate_function():
    config = parse_train_args([*EVAL_ONLY, "--custom-generate-function-path", "test_custom_generate.two_turns"])
    assert config.rollout.custom_generate.spec == "test_custom_generate.two_turns"
    assert config.rollout.custom_generate.as_namespace("127.0.0.1", 30000).n_samples_per_eval_prompt == 1  # slime's name


def test_eval_only_takes_the_training_flags_that_have_defaults_and_checks_them_as_for_a_run(capsys):
    """(unused: the loop runs no step; the dry-run says so)"""
    config = parse_train_args([*EVAL_ONLY, "--num-steps", "3", "--lr", "1e-6", "--rollout-batch-size", "4"])
    assert config.run.mode is RunMode.EVAL_ONLY and config.run.num_steps == 3
    err = parse_error([*EVAL_ONLY, "--rollout-batch-size", "3", "--global-batch-size", "5"], capsys)
    assert "= 24 samples is not a multiple of --global-batch-size 5" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eval-interval", "2"], "--eval-only evaluates --hf-checkpoint once, without training: --eval-interval "
         "would do nothing; drop them"),
        (["--prompt-data", "p.jsonl", "--rollout-shuffle"], ": --prompt-data, --rollout-shuffle would do nothing"),
        (["--save", "s", "--save-rollout-data", "d"], ": --save, --save-rollout-data would do nothing"),
        (["--load", "s"], "`relax convert`"),
        (["--debug-rollout-only"], ": --debug-rollout-only would do nothing"),
        (["--over-sampling-batch-size", "64"], ": --over-sampling-batch-size would do nothing"),
    ],
)
def test_eval_only_refuses_the_flags_that_would_do_nothing(args, message, capsys):
    assert message in parse_error([*EVAL_ONLY, *args], capsys)


def test_slime_users_eval_prompt_data_is_relaxs_own():
    assert list(parse_train_args([*RUN, "--eval-prompt-data", "aime", "aime.jsonl"]).evaluation.datasets) == ["aime"]
