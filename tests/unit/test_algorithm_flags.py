"""Every algorithm flag does something: given a value other than its default, each one either changes the loss
the actor computes (through the settings relax.args builds and the loop's batch assembly, relax.run.loop) or is refused at parse time
with a message naming what to do. The flags come from the parser, so a new one without a case here fails."""

import functools

import pytest
import torch

from helpers import DRY_RUN
from relax.args import build_parser, parse_train_args
from relax.run.loop import rollout_batch
from relax.rollout.data import Prompt
from relax.rollout.groups import Sample
from relax.train.losses import aggregation_denominator
from relax.train.off_policy import corrected_policy_loss

GROUPS = ("relax: algorithm", "relax: off-policy correction")
BASE = [*DRY_RUN, "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8"]
KL = ["--use-kl-loss", "--kl-coef", "0.1"]
TIS = ["--use-tis"]
GSPO = ["--advantage-estimator", "gspo"]

# flag -> cases: (argv, baseline argv) whose losses must differ, or (argv, message) that must be refused.
CHANGES, REFUSED = "changes", "refused"
CASES = {
    "--advantage-estimator": [
        (CHANGES, ["--advantage-estimator", "gspo"], []),
        (CHANGES, ["--advantage-estimator", "cispo"], []),
        (CHANGES, ["--advantage-estimator", "rloo"], []),
        (CHANGES, ["--advantage-estimator", "reinforce_plus_plus"], []),
        (REFUSED, ["--advantage-estimator", "dapo"], "DAPO is --advantage-estimator grpo with clip-higher"),
        (REFUSED, [*GSPO, "--n-samples-per-prompt", "1"], "which one response (--n-samples-per-prompt 1) does not"),
        (REFUSED, ["--advantage-estimator", "rloo", "--n-samples-per-prompt", "1"], "rloo takes each response's"),
    ],
    "--eps-clip": [
        (CHANGES, ["--eps-clip", "0.1"], []),
        (CHANGES, [*GSPO, "--eps-clip", "0.2"], GSPO),  # GSPO's own default is 3e-4
    ],
    "--eps-clip-high": [(CHANGES, ["--eps-clip-high", "0.5"], [])],
    "--eps-clip-c": [
        (CHANGES, ["--eps-clip-c", "1.5"], []),
        (REFUSED, ["--eps-clip-c", "1"], "--eps-clip-c 1.0 must be > 1"),
        (REFUSED, ["--advantage-estimator", "cispo", "--eps-clip-c", "3"], "drop --eps-clip-c"),
    ],
    "--log-ratio-clamp": [(CHANGES, ["--log-ratio-clamp", "0.1"], [])],
    "--k3-clamp": [
        (CHANGES, [*KL, "--k3-clamp", "0.001"], KL),
        (REFUSED, ["--k3-clamp", "1"], "--k3-clamp only applies with --use-kl-loss and the k3 estimator"),
        (REFUSED, [*KL, "--kl-loss-type", "k2", "--k3-clamp", "1"], "--k3-clamp only applies with --use-kl-loss"),
    ],
    "--kl-coef": [
        (REFUSED, ["--kl-coef", "0.1"], "--kl-coef 0.1 without --use-kl-loss would do nothing"),
        (CHANGES, KL, []),
        (CHANGES, ["--use-kl-loss", "--kl-coef", "0.5"], KL),
    ],
    "--kl-loss-type": [
        (REFUSED, ["--kl-loss-type", "k1"], "--kl-loss-type only applies with --use-kl-loss"),
        (CHANGES, [*KL, "--kl-loss-type", "k1"], KL),
        (CHANGES, [*KL, "--kl-loss-type", "k2"], KL),
    ],
    "--use-kl-loss": [(REFUSED, ["--use-kl-loss"], "--use-kl-loss with --kl-coef 0 adds nothing")],
    "--entropy-coef": [(CHANGES, ["--entropy-coef", "0.01"], [])],
    "--loss-aggregation": [
        *(
            (CHANGES, ["--loss-aggregation", mode], [])
            for mode in ("seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
        ),
        (CHANGES, [*GSPO, "--loss-aggregation", "token-mean"], GSPO),  # GSPO's own default is the sequence mean
    ],
    "--normalize-advantages-by-std": [
        (CHANGES, ["--no-normalize-advantages-by-std"], []),
        (REFUSED, ["--advantage-estimator", "rloo", "--no-normalize-advantages-by-std"], "changes nothing with"),
    ],
    "--use-tis": [(CHANGES, TIS, [])],
    "--tis-clip": [
        (REFUSED, ["--tis-clip", "1.5"], "--tis-clip and --tis-clip-low only apply with --use-tis"),
        (CHANGES, [*TIS, "--tis-clip", "1.5"], TIS),
    ],
    "--tis-clip-low": [
        (REFUSED, ["--tis-clip-low", "0.5"], "--tis-clip and --tis-clip-low only apply with --use-tis"),
        (CHANGES, [*TIS, "--tis-clip-low", "0.5"], TIS),
        (REFUSED, [*TIS, "--tis-clip", "1.5", "--tis-clip-low", "2"], "--tis-clip-low 2.0 is above --tis-clip 1.5"),
    ],
    "--rollout-rs": [
        (REFUSED, ["--rollout-rs", "seq_mean_k1"], "--rollout-rs seq_mean_k1 needs --rollout-rs-threshold"),
        (CHANGES, ["--rollout-rs", "seq_mean_k1", "--rollout-rs-threshold", "1.5"], []),
    ],
    "--rollout-rs-threshold": [
        (REFUSED, ["--rollout-rs-threshold", "1.5"], "--rollout-rs-threshold only applies with --rollout-rs"),
        (CHANGES, ["--rollout-rs", "seq_mean_k1", "--rollout-rs-threshold", "0.9_1.2"],
         ["--rollout-rs", "seq_mean_k1", "--rollout-rs-threshold", "1.5"]),
    ],
    "--use-rollout-logprobs": [
        (CHANGES, ["--use-rollout-logprobs"], []),
        (REFUSED, [*TIS, "--use-rollout-logprobs"], "--use-tis and --use-rollout-logprobs exclude each other"),
    ],
    # On a MoE model it changes the actor's logprobs (and so the loss) to the engine's routing: tests/e2e/
    # test_train_megatron.py test_routing_replay_routes_every_token_as_the_engine_did. This model is dense.
    "--use-rollout-routing-replay": [
        (REFUSED, ["--use-rollout-routing-replay"], "replays the experts a MoE model's routers chose"),
    ],
}


def _algorithm_flags() -> set[str]:
    parser = build_parser()
    return {
        action.option_strings[0]
        for group in parser._action_groups
        if group.title in GROUPS
        for action in group._group_actions
    }


def test_every_algorithm_flag_has_a_case():
    assert _algorithm_flags() == set(CASES)


# Eight responses to two prompts, of different lengths and rewards. The engine's logprobs are the actor's old
# ones plus noise, so TIS truncates some tokens and MIS drops some sequences; the current policy has moved from
# the old one enough for the PPO clip to act.
LENGTHS = [3, 5, 1, 8, 2, 6, 4, 7]
REWARDS = [1.0, 0.0, 0.5, 1.0, 0.0, 0.0, 1.0, 0.25]


def _tensors():
    generator = torch.Generator().manual_seed(0)
    shape = (len(LENGTHS), max(LENGTHS))

    def random(scale, shift=0.0):
        return shift + scale * torch.randn(shape, generator=generator)

    old = random(0.5, -2.0).clamp(max=-0.05)
    return dict(
        old=old,
        current=old + random(0.3),
        rollout=old + random(0.6),
        ref=old + random(0.2),
        entropy=random(0.1, 1.0).abs(),
    )


TENSORS = _tensors()


def _samples() -> list[Sample]:
    prompts = [Prompt(0, [1, 2], "a"), Prompt(1, [3], "b")]
    return [
        Sample(prompts[i // 4], list(range(4, 4 + n)), TENSORS["rollout"][i, :n].tolist(), "stop", reward=reward)
        for i, (n, reward) in enumerate(zip(LENGTHS, REWARDS))
    ]


@functools.cache
def _loss(argv: tuple[str, ...]) -> float:
    """The loss the actor computes for the whole batch as one micro-batch, with the settings and the batch the
    loop makes from these flags."""
    config = parse_train_args([*BASE, *argv])
    settings = config.actor
    batch = rollout_batch(_samples(), config.algorithm)
    mask = torch.zeros(len(LENGTHS), max(LENGTHS))
    for i, length in enumerate(LENGTHS):
        mask[i, :length] = 1

    def padded(values):
        return torch.nn.utils.rnn.pad_sequence(values, batch_first=True)

    loss, _ = corrected_policy_loss(
        settings.loss,
        settings.rollout_correction,
        TENSORS["current"] * mask,
        padded(batch.advantages),
        mask,
        old_logprobs=TENSORS["old"] * mask,
        rollout_logprobs=padded(batch.rollout_logprobs),
        ref_logprobs=TENSORS["ref"] * mask if settings.keep_reference else None,
        entropy=TENSORS["entropy"] * mask,
        denominator=aggregation_denominator(mask, settings.loss.aggregation, settings.loss.norm_length),
    )
    return loss.item()


@pytest.mark.parametrize(
    "flag, kind, argv, expected",
    [(flag, *case) for flag, cases in CASES.items() for case in cases],
    ids=[f"{flag} {' '.join(case[1])}" for flag, cases in CASES.items() for case in cases],
)
def test_flag_changes_the_loss_or_is_refused(flag, kind, argv, expected, capsys):
    assert flag.lstrip("-") in " ".join(argv)  # (--no-X gives X)
    if kind == REFUSED:
        with pytest.raises(SystemExit):
            parse_train_args([*BASE, *argv])
        assert expected in capsys.readouterr().err
    else:
        assert _loss(tuple(argv)) != pytest.approx(_loss(tuple(expected)), rel=1e-4, abs=1e-6)
