"""The algorithm records (relax.train.algorithms) are what the flags offer and what the actor's loss does."""

import pytest
import torch

from helpers import DRY_RUN as RUN
from relax.args import build_parser, parse_train_args
from relax.train.algorithms import ALGORITHMS
from relax.train.losses import policy_loss


def test_the_estimator_flag_offers_the_records():
    (action,) = [a for a in build_parser()._actions if a.dest == "advantage_estimator"]
    assert list(action.choices) == list(ALGORITHMS)
    for algorithm in ALGORITHMS.values():
        assert f"{algorithm.name}: {algorithm.summary}" in action.help


@pytest.mark.parametrize("algorithm", ALGORITHMS.values(), ids=lambda a: a.name)
def test_a_run_trains_with_the_record_loss_and_reports_its_metrics(algorithm):
    config = parse_train_args([*RUN, "--advantage-estimator", algorithm.name])
    loss = config.actor.loss
    assert (loss.loss_mode, loss.ratio_level, loss.aggregation) == (
        algorithm.loss_mode, algorithm.ratio_level, algorithm.aggregation
    )
    assert (loss.clip_low, loss.clip_high) == algorithm.clip_range
    assert (loss.dual_clip is not None) == algorithm.dual_clip
    logprobs = torch.tensor([[-1.0, -2.0]])
    _, metrics = policy_loss(loss, logprobs, logprobs - 0.1, torch.ones(1, 2), torch.ones(1, 2))
    assert sorted(metrics) == sorted(algorithm.metrics)
