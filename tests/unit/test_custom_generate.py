import asyncio
import textwrap
from dataclasses import dataclass

import pytest

from relax.rollout.custom_generate import load_custom_generate_fn, sample_problem

FUNCTIONS = '''
async def generate(args, sample, sampling_params):
    return ("plain", args, sample, sampling_params)

async def generate_for_eval(args, sample, sampling_params, evaluation=False):
    return ("eval", evaluation)

async def with_options(args, sample, sampling_params, *, retries=3, **more):
    return "options"

def blocking(args, sample, sampling_params):
    return sample

async def two_parameters(args, sample):
    return sample

async def needs_more(args, sample, sampling_params, engine):
    return sample

async def positional_evaluation(args, sample, sampling_params, evaluation, /):
    return sample

not_a_function = 3
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    package = tmp_path / "my_rollouts"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "agent.py").write_text(textwrap.dedent(FUNCTIONS))
    (tmp_path / "broken_rollout.py").write_text("import no_such_dependency_of_the_user\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rollouts.agent"


def test_slimes_dotted_path_and_module_colon_function(module):
    for spec in (f"{module}.generate", f"{module}:generate"):
        fn = load_custom_generate_fn(spec)
        assert not fn.takes_evaluation and fn.spec == spec
        assert asyncio.run(fn("args", "sample", {"temperature": 1.0}, evaluation=True)) == (
            "plain", "args", "sample", {"temperature": 1.0}
        )


def test_evaluation_reaches_only_a_function_that_declares_it(module):
    fn = load_custom_generate_fn(f"{module}.generate_for_eval")
    assert fn.takes_evaluation
    assert asyncio.run(fn("args", "sample", {}, evaluation=True)) == ("eval", True)
    assert asyncio.run(fn("args", "sample", {})) == ("eval", False)
    assert asyncio.run(load_custom_generate_fn(f"{module}:with_options")(None, None, {})) == "options"


@pytest.mark.parametrize("name, reason", [
    ("blocking", "not an async function"),
    ("two_parameters", "cannot be called as fn(args, sample, sampling_params) (too many positional arguments)"),
    ("needs_more", "cannot be called as fn(args, sample, sampling_params) (missing a required argument: 'engine')"),
    ("positional_evaluation", "cannot be called as fn(args, sample, sampling_params, evaluation=False)"),
    ("not_a_function", "module 'my_rollouts.agent' has no function 'not_a_function'"),
    ("missing", "module 'my_rollouts.agent' has no function 'missing'"),
])
def test_a_function_that_does_not_fit_the_contract_is_refused_saying_why(module, name, reason):
    with pytest.raises(ValueError, match="--custom-generate-function-path") as refused:
        load_custom_generate_fn(f"{module}.{name}")
    assert reason in str(refused.value)


@pytest.mark.parametrize("spec, reason", [
    ("generate", "name a function as module:function or module.path.function"),
    ("my_rollouts.agent:", "name a function as module:function or module.path.function"),
    ("no_such_package.generate", "cannot import module 'no_such_package': ModuleNotFoundError"),
    ("broken_rollout:generate", "cannot import module 'broken_rollout': ModuleNotFoundError: No module named "
                                "'no_such_dependency_of_the_user'"),
])
def test_a_spec_that_names_no_function_is_refused(module, spec, reason):
    with pytest.raises(ValueError) as refused:
        load_custom_generate_fn(spec)
    assert reason in str(refused.value)


@dataclass
class SlimeSample:
    tokens: list
    response_length: int
    loss_mask: list | None = None
    rollout_log_probs: list | None = None


PROMPT = [7, 8, 9]


def test_an_aligned_sample_has_no_problem():
    assert sample_problem(SlimeSample(PROMPT + [1, 2, 3], 3, [1, 0, 1], [-0.5, 0.0, -0.1]), PROMPT) is None
    assert sample_problem(SlimeSample(PROMPT + [1], 1), PROMPT) is None  # no mask, no logprobs: slime's defaults


@pytest.mark.parametrize("sample, reason", [
    (SlimeSample((7, 8, 9, 1), 1), "its tokens are tuple, not a list of token ids"),
    (SlimeSample([7, 8, 1, 2], 1), "its tokens do not start with the prompt's 3 ids"),
    (SlimeSample(PROMPT + [1, 2], 3), "its response_length is 3, but its tokens hold 2 after the prompt"),
    (SlimeSample(PROMPT + [1, 2], 2, [1]), "its loss_mask has 1 entries for 2 response tokens"),
    (SlimeSample(PROMPT + [1, 2], 2, None, [-1.0, -1.0, -1.0]), "its rollout_log_probs has 3 entries for 2 response"),
    (SlimeSample(PROMPT + [1, 2], 2, [1, 2]), "its loss_mask holds values other than 0 and 1"),
])
def test_a_misaligned_sample_is_a_problem_named(sample, reason):
    assert reason in sample_problem(sample, PROMPT)
