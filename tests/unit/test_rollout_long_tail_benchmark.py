"""benchmarks/rollout_long_tail.py's own logic: the chain's stop probabilities and median, and the figures it reads
from a run's metrics rows."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from rollout_long_tail import (  # noqa: E402
    PROMPT_END, length_cdf, mode_summary, quantile, regime_means, transition_logits,
)

from relax.tools.tiny_model import build_tokenizer  # noqa: E402


def chain_args(median: int, sigma: float, regimes: int = 8) -> argparse.Namespace:
    return argparse.Namespace(median_response=median, regime_sigma=sigma, regimes=regimes)


@pytest.mark.parametrize("median,sigma", [(48, 0.5), (256, 0.5), (48, 0.0)])
def test_the_groups_mean_lengths_give_the_median_asked_for(median, sigma):
    means = regime_means(chain_args(median, sigma))
    assert length_cdf(median, means) == pytest.approx(0.5, abs=1e-6)
    ratios = [b / a for a, b in zip(means, means[1:])]
    assert all(r == pytest.approx(1.0) for r in ratios) if sigma == 0 else all(r > 1 for r in ratios)


def test_a_group_token_stops_with_its_groups_probability_and_the_prompt_end_never_stops(tmp_path):
    tokenizer = build_tokenizer(tmp_path)
    means = [10.0, 100.0]
    probabilities = torch.softmax(transition_logits(tokenizer, means), dim=-1)
    eos = tokenizer.eos_token_id
    start = tokenizer.encode(PROMPT_END, add_special_tokens=False)[0]
    assert probabilities[start, eos] < 1e-12
    first_tokens = (probabilities[start] > 1e-12).nonzero().flatten().tolist()
    assert len(first_tokens) == 2 * 25  # the 51 alphabet tokens but ":" in two groups of 25
    stops = {}
    for token in first_tokens:
        following = (probabilities[token] > 1e-12).nonzero().flatten().tolist()
        assert eos in following and len(following) == 26  # its group, or EOS
        stops[token] = probabilities[token, eos].item()
    assert sorted(set(round(p, 6) for p in stops.values())) == [0.01, 0.1]


def test_quantile_is_the_smallest_value_with_that_share_at_or_below_it():
    values = list(range(1, 101))
    assert (quantile(values, 0.5), quantile(values, 0.9), quantile(values, 1.0)) == (50, 90, 100)
    assert quantile([7], 0.99) == 7


def test_the_summary_reads_the_steps_after_the_first_that_ran_a_rollout():
    rows = [
        {"step": 0, "perf/step_time": 9.0, "perf/rollout_time": 8.0},  # warm-ups
        {"step": 1, "perf/step_time": 2.0, "perf/rollout_time": 1.0, "perf/train_time": 0.5,
         "rollout/aborted_groups": 4.0},
        {"step": 2, "perf/step_time": 4.0, "perf/rollout_time": 1.0, "perf/train_time": 2.0,
         "rollout/aborted_groups": 2.0},
        {"step": 3, "perf/step_time": 3.0, "perf/rollout_time": 1.0, "perf/train_time": 1.0,
         "rollout/aborted_groups": 0.0, "perf/save_time": 0.3},  # a phase of one step only: no median
        {"step": 4, "perf/step_time": 0.5},  # async's last step: no rollout
    ]
    summary = mode_summary(rows, samples_per_step=64)
    assert summary["steps_measured"] == 3
    assert summary["step_time_median_s"] == 3.0
    assert summary["step_times_s"] == [2.0, 4.0, 3.0]
    assert summary["trained_samples_per_s"] == pytest.approx(3 * 64 / 9.0)  # the steps' samples over their time
    assert summary["rollout_share"] == pytest.approx(3.0 / 9.0)
    assert summary["aborted_groups_per_step"] == 2.0
    assert summary["phase_medians_s"] == {"rollout_time": 1.0, "train_time": 1.0}
    with pytest.raises(ValueError, match="--num-steps 3"):
        mode_summary(rows[:1], samples_per_step=64)
