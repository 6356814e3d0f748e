"""Prompt data through `relax train`: the dry run reads every row the run would, and a data error ends a dry run
or a run with one line naming the file and the row, exit status 2, no traceback. The dry run checks the checkpoint
--load names and every step's file --load-rollout-data names likewise."""

import pytest

from helpers import write_jsonl
from relax.cli import main
from relax.rollout.data import Prompt
from relax.rollout.dump import save_rollout_data
from relax.rollout.groups import Sample
from relax.tools.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model"), "qwen3")


def train_argv(checkpoint, data, *extra):
    """A run of the tiny model, whose 512-token context holds these prompts with 8-token responses."""
    return ["train", "--device", "cpu", "--hf-checkpoint", str(checkpoint), "--prompt-data", str(data),
            "--reward-fn", "copy_digit", "--lr", "1e-2", "--apply-chat-template", "--rollout-max-response-len", "8",
            *extra]


def test_the_dry_run_reads_rows_of_only_prompt_and_label(tmp_path, checkpoint, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "copy 1:", "label": "1"}, {"prompt": "copy 2:", "label": "2"}])
    assert main(train_argv(checkpoint, data, "--dry-run", "--system-prompt", "be brief.")) == 0
    assert f"prompt data: {data}: 2 rows, 2 prompts kept" in capsys.readouterr().out


@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry run", "run"])
def test_a_bad_row_ends_it_with_one_line(tmp_path, checkpoint, capsys, dry_run):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "copy 1:", "label": "1"}, {"question": "copy 2:"}])
    assert main(train_argv(checkpoint, data, *dry_run, "--output-dir", str(tmp_path / "out"))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"relax train: {data} row 2: key 'prompt' missing (row has keys: question) "
        "(pass skip_bad_rows / --skip-bad-rows to skip such rows)"
    )


def test_the_dry_run_says_when_it_could_not_check_the_data(tmp_path, checkpoint, capsys):
    assert main(train_argv(checkpoint, tmp_path / "absent.jsonl", "--dry-run")) == 0
    assert f"prompt data: not checked (--prompt-data {tmp_path / 'absent.jsonl'} does not exist)" in (
        capsys.readouterr().out
    )


def test_the_dry_run_checks_the_checkpoint_to_resume(tmp_path, checkpoint, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "copy 1:", "label": "1"}])
    assert main(train_argv(checkpoint, data, "--dry-run", "--load", str(tmp_path / "later"))) == 0
    assert f"--load: not checked (--load {tmp_path / 'later'} does not exist)" in capsys.readouterr().out
    (tmp_path / "saves").mkdir()
    assert main(train_argv(checkpoint, data, "--dry-run", "--load", str(tmp_path / "saves"))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        f"relax train: --load {tmp_path / 'saves'}: no checkpoint there"
    )


def test_the_dry_run_reads_every_eval_set_and_names_the_set_file_and_row(tmp_path, checkpoint, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "copy 1:", "label": "1"}])
    good = write_jsonl(tmp_path / "good.jsonl", [{"prompt": "copy 0:", "label": "0"}] * 3)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "copy 0:", "label": "0"}, {"prompt": "copy 1:"}])
    eval_sets = ["--eval-prompt-data", "good", str(good), "later", str(tmp_path / "later.jsonl")]
    assert main(train_argv(checkpoint, data, "--dry-run", *eval_sets)) == 0
    out = capsys.readouterr().out
    assert f"eval set good: {good}: 3 rows, 3 prompts kept" in out
    assert f"eval set later: not checked (--eval-prompt-data later {tmp_path / 'later.jsonl'} does not exist)" in out
    assert main(train_argv(checkpoint, data, "--dry-run", *eval_sets, "bad", str(bad))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        f"relax train: --eval-prompt-data bad: {bad} row 2: key 'label' missing (row has keys: prompt) "
        "(pass skip_bad_rows / --skip-bad-rows to skip such rows)"
    )


def test_the_eval_only_dry_run_reads_the_eval_sets_and_says_the_training_flags_are_unused(tmp_path, checkpoint, capsys):
    held_out = write_jsonl(tmp_path / "held_out.jsonl", [{"prompt": "copy 0:", "label": "0"}] * 2)
    argv = ["train", "--device", "cpu", "--hf-checkpoint", str(checkpoint), "--reward-fn", "copy_digit", "--dry-run",
            "--eval-prompt-data", "held_out", str(held_out), "--eval-only", "--num-steps", "3",
            "--eval-max-response-len", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert f"eval set held_out: {held_out}: 2 rows, 2 prompts kept" in out
    assert "prompt data: none (--eval-only evaluates --hf-checkpoint on the eval sets once; the training flags" in out
    assert "are checked as for a run but unused)" in out


def save_rollouts(pattern, steps, num_groups):
    """Real rollout data files of `num_groups` groups of 2 samples each for `steps`, as --save-rollout-data writes."""
    for step in steps:
        samples = []
        for row in range(num_groups):
            prompt = Prompt(row=row, token_ids=[1, 2], text=f"copy {row}:", label=str(row))
            samples += [Sample(prompt, [3], [-0.5], "stop", str(row), reward=1.0) for _ in range(2)]
        save_rollout_data(pattern, step, samples, samples_per_prompt=2)


def replay_argv(checkpoint, pattern, *extra):
    """A run replaying `pattern` for 3 steps of 2 groups of 2 samples: no prompt data, no reward function."""
    return ["train", "--device", "cpu", "--hf-checkpoint", str(checkpoint), "--lr", "1e-2",
            "--load-rollout-data", pattern, "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--num-steps", "3", *extra]


def test_the_dry_run_reads_every_step_of_the_replayed_rollout_data(tmp_path, checkpoint, capsys):
    pattern = str(tmp_path / "step_{step}.jsonl")
    save_rollouts(pattern, range(3), num_groups=2)
    assert main(replay_argv(checkpoint, pattern, "--dry-run")) == 0
    assert f"rollout data: {pattern}: 3 files read, steps 0-2, 2 groups x 2 samples" in capsys.readouterr().out
    one_file = str(tmp_path / "step_0.jsonl")  # no {step}: the same rollout every step
    assert main(replay_argv(checkpoint, one_file, "--dry-run")) == 0
    assert f"rollout data: {one_file}: 1 file read, steps 0-2, 2 groups x 2 samples" in capsys.readouterr().out
    # The first step replayed is the --load checkpoint's: unknown while it is not there.
    assert main(replay_argv(checkpoint, pattern, "--dry-run", "--load", str(tmp_path / "later"))) == 0
    assert "rollout data: not checked (the run's first step is that of the --load checkpoint, not checked)" in (
        capsys.readouterr().out
    )


@pytest.mark.parametrize(
    "steps, num_groups, error",
    [
        ([0, 2], 2, "--load-rollout-data, step 1: {dir}/step_1.jsonl does not exist (write it with "
                    "--save-rollout-data {dir}/step_{{step}}.jsonl)"),
        ([0, 1, 2], 3, "--load-rollout-data, step 0: {dir}/step_0.jsonl holds 3 groups of 2 samples; this run trains "
                       "on --rollout-batch-size 2 groups of --n-samples-per-prompt 2: use the flags the file was "
                       "saved with"),
    ],
    ids=["missing step", "group count"],
)
@pytest.mark.parametrize("dry_run", [["--dry-run"], []], ids=["dry run", "run"])
def test_replayed_rollout_data_of_another_shape_or_a_missing_step_ends_it_with_one_line(
    tmp_path, checkpoint, capsys, steps, num_groups, error, dry_run
):
    """The run checks every step's file (its header) before it starts any worker, as the dry run does (reading it
    whole)."""
    pattern = str(tmp_path / "step_{step}.jsonl")
    save_rollouts(pattern, steps, num_groups)
    assert main(replay_argv(checkpoint, pattern, *dry_run, "--output-dir", str(tmp_path / "out"))) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"relax train: {error.format(dir=tmp_path)}"
