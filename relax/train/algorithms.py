"""One record per algorithm that --advantage-estimator names: how its advantages are computed, what they need, and
the policy loss they are trained with (its mode, ratio level, default clip range and aggregation, the metrics it
reports). The flags' choices and help, their defaults, the parse-time checks, the actor's loss settings and the
loop's advantages all read these records; adding an algorithm is adding a record (and its functions in
relax.train.advantages / relax.train.losses).
"""

import dataclasses
from typing import Protocol

import torch

from relax.train.advantages import (
    GroupSize,
    grpo_sequence_advantages,
    reinforce_plus_plus_advantages,
    rloo_sequence_advantages,
    to_tokens,
)

# The metrics relax.train.losses.policy_loss reports for every loss mode (and kl, entropy when they are in the loss)
COMMON_LOSS_METRICS = ("loss", "pg_loss", "clip_fraction", "ppo_kl")


class AdvantageFunction(Protocol):
    def __call__(
        self,
        rewards: torch.Tensor,  # [N], the responses to one prompt contiguous
        mask: torch.Tensor,  # [N, T] response tokens
        group_size: GroupSize,  # every group's size, or each group's (relax.train.advantages)
        normalize_std: bool,
        kl: torch.Tensor | None,  # [N, T] per-token KL to the reference, for estimators that shape the reward
        kl_coef: float,
        gamma: float,
    ) -> torch.Tensor:  # [N, T], zero on padding
        ...


def _group_relative(rewards, mask, group_size, normalize_std, kl, kl_coef, gamma):
    return to_tokens(grpo_sequence_advantages(rewards, group_size, normalize_std), mask)


def _leave_one_out(rewards, mask, group_size, normalize_std, kl, kl_coef, gamma):
    return to_tokens(rloo_sequence_advantages(rewards, group_size), mask)


def _reinforce_plus_plus(rewards, mask, group_size, normalize_std, kl, kl_coef, gamma):
    return reinforce_plus_plus_advantages(rewards, mask, group_size, kl, kl_coef, gamma)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    name: str  # the --advantage-estimator value
    summary: str  # for --help
    advantages: AdvantageFunction
    divides_by_group_std: bool  # --normalize-advantages-by-std applies (then a group needs two responses)
    # Why it needs two or more responses per prompt whatever --normalize-advantages-by-std says; None: it does not
    needs_group_because: str | None = None
    loss_mode: str = "ppo"  # relax.train.losses.LOSS_MODES
    ratio_level: str = "token"  # relax.train.losses.RATIO_LEVELS
    clip_range: tuple[float, float] = (0.2, 0.2)  # (--eps-clip, --eps-clip-high) when not given
    aggregation: str = "token_mean"  # --loss-aggregation when not given (relax.train.losses.AGGREGATIONS)

    @property
    def dual_clip(self) -> bool:
        """The loss has PPO's dual-clip bound (--eps-clip-c); CISPO's capped weights need none."""
        return self.loss_mode == "ppo"

    @property
    def metrics(self) -> tuple[str, ...]:
        """The train/ metrics its loss reports (besides kl and entropy, when they are in the loss)."""
        return COMMON_LOSS_METRICS + (("dual_clip_fraction",) if self.dual_clip else ())


ALGORITHMS = {
    algorithm.name: algorithm
    for algorithm in (
        Algorithm(
            "grpo",
            "each reward minus its group's mean, over the group's std unless --no-normalize-advantages-by-std "
            "(Dr. GRPO); PPO's clipped token ratio",
            _group_relative,
            divides_by_group_std=True,
        ),
        # GSPO's paper (arXiv:2507.18071) clips its sequence ratio at 3e-4 / 4e-4 and averages over sequences.
        Algorithm(
            "gspo",
            "GRPO's advantages, GSPO's length-normalised sequence ratio (its clip range and sequence-mean "
            "aggregation unless given)",
            _group_relative,
            divides_by_group_std=True,
            ratio_level="sequence",
            clip_range=(3e-4, 4e-4),
            aggregation="seq_mean_token_mean",
        ),
        Algorithm(
            "cispo",
            "GRPO's advantages, CISPO's capped stop-gradient ratio weight on log pi",
            _group_relative,
            divides_by_group_std=True,
            loss_mode="cispo",
        ),
        Algorithm(
            "rloo",
            "each reward minus the mean of the other responses to its prompt",
            _leave_one_out,
            divides_by_group_std=False,
            needs_group_because="takes each response's baseline from the other responses to its prompt",
        ),
        Algorithm(
            "reinforce_plus_plus",
            "REINFORCE++: returns whitened over the batch's tokens (the group's mean subtracted first when "
            "--n-samples-per-prompt > 1)",
            _reinforce_plus_plus,
            divides_by_group_std=False,
        ),
    )
}
ESTIMATORS = tuple(ALGORITHMS)
STD_NORMALISED = tuple(name for name, algorithm in ALGORITHMS.items() if algorithm.divides_by_group_std)


def compute_advantages(
    estimator: str,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    group_size: GroupSize,
    normalize_std: bool = True,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Per-token advantages [N, T] by estimator name (one of ESTIMATORS)."""
    if estimator not in ALGORITHMS:
        raise ValueError(f"advantage estimator {estimator!r} is not supported; choose one of {list(ESTIMATORS)}")
    if rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"{rewards.shape[0]} rewards for {mask.shape[0]} responses")
    return ALGORITHMS[estimator].advantages(rewards, mask, group_size, normalize_std, kl, kl_coef, gamma)
