"""What a run reads before any worker starts (relax.run.inputs), as `relax train --dry-run` reads it: the reward
function is imported there, for a run that generates and for one that replays rollouts and evaluates. The prompt
data, eval sets, checkpoint and rollout data: tests/unit/test_cli_data.py; the earlier record:
tests/unit/test_metrics.py."""

import pytest

from relax.args import parse_train_args
from relax.run.inputs import InputError, read_inputs

SIZE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"]
BASE = ["--lr", "1e-6", "--device", "cpu", "--dry-run", *SIZE]
GENERATING = [*BASE, "--prompt-data", "prompts.jsonl"]
REPLAYING_AND_EVALUATING = [
    *BASE, "--load-rollout-data", "rollouts/{step}.jsonl", "--eval-prompt-data", "held_out", "h.jsonl",
]


@pytest.mark.parametrize("argv", [GENERATING, REPLAYING_AND_EVALUATING], ids=["generating", "replaying, evaluating"])
def test_a_reward_function_that_does_not_import_is_refused_before_the_run(argv, tmp_path):
    config = parse_train_args([*argv, "--output-dir", str(tmp_path), "--reward-fn", "relax_no_such_module:score"])
    with pytest.raises(InputError) as refused:
        read_inputs(config, dry_run=True)
    assert "--reward-fn relax_no_such_module:score: cannot import module 'relax_no_such_module'" in str(refused.value)


def test_the_reward_function_read_is_the_one_the_run_calls(tmp_path):
    config = parse_train_args([*GENERATING, "--output-dir", str(tmp_path), "--reward-fn", "math"])
    assert read_inputs(config, dry_run=True).reward_fn.name == "math"
