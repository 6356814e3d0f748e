"""slime's spellings of relax flags: each sets what relax's spelling sets, giving both is refused, --help lists
them, and every other slime flag is still refused (with what to do where relax has no flag of the same meaning)."""

import pytest

from helpers import DRY_RUN as RUN, parse_error
from relax.args import build_parser, parse_train_args
from relax.args.relax_flags import SLIME_SPELLINGS
from relax.args.sglang import sglang_actions
from relax.args.unsupported import SLIME_FLAGS

# relax flag -> (a value other than its default, flags that make the value valid)
GIVEN = {
    "--num-steps": ("7", []),
    "--rollout-num-devices-per-engine": ("2", ["--num-devices-per-node", "2"]),
    "--max-tokens-per-device": ("64", ["--use-dynamic-batch-size"]),
    "--log-probs-max-tokens-per-device": ("128", ["--use-dynamic-batch-size", "--max-tokens-per-device", "64"]),
    "--num-nodes": ("2", []),
    "--num-devices-per-node": ("2", []),
    "--max-prompt-length": ("16", []),
    "--kl-coef": ("0.1", ["--use-kl-loss"]),
    "--rollout-num-devices": ("2", ["--no-colocate"]),
}


def test_every_slime_spelling_has_a_case():
    assert set(GIVEN) == set(SLIME_SPELLINGS)


@pytest.mark.parametrize("flag", list(SLIME_SPELLINGS))
def test_slime_spelling_sets_what_relax_spelling_sets(flag):
    value, context = GIVEN[flag]
    ours = parse_train_args([*RUN, *context, flag, value])
    theirs = parse_train_args([*RUN, *context, SLIME_SPELLINGS[flag], value])
    dest = flag.removeprefix("--").replace("-", "_")
    assert str(getattr(theirs.flags, dest)) == value  # given, not the default
    assert vars(theirs.flags) == vars(ours.flags)
    for settings in ("run", "rollout", "algorithm", "actor"):
        assert getattr(theirs, settings) == getattr(ours, settings)


@pytest.mark.parametrize("flag", list(SLIME_SPELLINGS))
def test_giving_both_spellings_is_refused_naming_both(flag, capsys):
    value, context = GIVEN[flag]
    alias = SLIME_SPELLINGS[flag]
    for both in ([flag, value, alias, value], [f"{alias}={value}", f"{flag}={value}"]):
        error = parse_error([*RUN, *context, *both], capsys)
        assert f"{alias} is another spelling of {flag}: give one of them" in error


def test_help_lists_each_slime_spelling_with_its_relax_flag():
    text = " ".join(build_parser().format_help().split())  # unwrapped
    assert "--num-steps N, --num-rollout N" in text
    for flag, alias in SLIME_SPELLINGS.items():
        assert f"{flag} " in text and f", {alias} " in text


def test_no_slime_spelling_is_an_sglang_or_megatron_spelling():
    """A bare SGLang flag is answered with its --sglang- spelling, and a Megatron flag is Megatron-LM's: an alias must
    take neither from them (a Megatron clash would already fail building the parser; SGLang's are not registered)."""
    parser = build_parser()
    sglang = {o for action in sglang_actions() for o in action.option_strings}
    megatron = {o for a in parser._actions if a.dest.startswith("megatron_") for o in a.option_strings}
    aliases = set(SLIME_SPELLINGS.values())
    assert aliases & (sglang | megatron | set(parser.redirects)) == set()
    assert set(SLIME_FLAGS) & {o for a in parser._actions for o in a.option_strings} == set()


@pytest.mark.parametrize("flag", ["--num-epoch", "--critic-num-gpus-per-node", "--rollout-seed", "--num-gpus-per-node"])
def test_other_slime_flags_are_still_refused(flag, capsys):
    assert f"unknown flag {flag}" in parse_error([*RUN, flag, "1"], capsys)


@pytest.mark.parametrize("flag", list(SLIME_FLAGS))
def test_slime_flags_without_a_relax_counterpart_say_what_to_do(flag, capsys):
    assert f"unknown flag {flag}: {SLIME_FLAGS[flag]}" in parse_error([*RUN, flag, "x"], capsys)
