"""slime's custom generate function (relax.rollout.custom_generate): loading and the signature check, the sample a
function gets, generate and the append helpers, what comes back (trained, aborted, or failed naming why), and a
step's groups of such samples through EngineWorker over a scripted engine (the real stack:
tests/e2e/test_loop_custom_generate.py)."""

import argparse
import asyncio
import json
import textwrap
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from relax.args.settings import AlgorithmSettings
from relax.rollout.agent_session import ChatSessions
from relax.rollout.custom_generate import (
    CustomGenerateFn, Sample, append_generated, append_masked, completion_of, generate, generate_samples,
    load_custom_generate_fn, sample_problem, tokens_left,
)
from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import CONTINUED_RESPONSE_PRIORITY, Completion, SamplingConfig
from relax.rollout.partial import ResponseSoFar
from relax.rollout.rewards import RewardFn
from relax.rollout.rollout import Partial, collect_groups, reward_and_length_metrics, samples_of
from relax.rollout.dump import load_rollout_data, save_rollout_data
from relax.rollout.groups import FillError, group_sizes
from relax.rollout.worker import EngineWorker
from relax.run.loop import rollout_batch
from relax.train.batch import optimizer_step_sizes

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
    assert sample_problem(SlimeSample(PROMPT + [1, 2, 3], 3, [1, 0, 1], [-0.5, 0.0, -0.1])) is None
    assert sample_problem(SlimeSample(PROMPT + [1], 1)) is None  # no mask, no logprobs: slime's defaults
    assert sample_problem(SlimeSample([4, 5, 1], 1)) is None  # a prompt of its own: the tokens before the response
    assert sample_problem(SlimeSample([4], 0)) is None  # no response yet


@pytest.mark.parametrize("sample, reason", [
    (SlimeSample((7, 8, 9, 1), 1), "its tokens are tuple, not a list of token ids"),
    (SlimeSample([7, 8.0, 1], 1), "its tokens hold values other than integer token ids"),
    (SlimeSample([1, 2], 2), "its response_length is 2, but its 2 tokens must hold the prompt's ids (at least one)"),
    (SlimeSample(PROMPT + [1, 2], 6), "its response_length is 6, but its 5 tokens must hold the prompt's ids"),
    (SlimeSample(PROMPT + [1, 2], -1), "its response_length is -1, but its 5 tokens must hold the prompt's ids"),
    (SlimeSample(PROMPT + [1, 2], None), "its response_length is None, but its 5 tokens must hold the prompt's"),
    (SlimeSample(PROMPT + [1, 2], 2, [1]), "its loss_mask has 1 entries for 2 response tokens"),
    (SlimeSample(PROMPT + [1, 2], 2, None, [-1.0, -1.0, -1.0]), "its rollout_log_probs has 3 entries for 2 response"),
    (SlimeSample(PROMPT + [1, 2], 2, [1, 2]), "its loss_mask holds values other than 0 and 1"),
])
def test_a_misaligned_sample_is_a_problem_named(sample, reason):
    assert reason in sample_problem(sample)


# --- the function's samples: generate, the append helpers, what comes back ----------------------------------------

TOOL = [50, 51]  # the ids a function appends itself


async def two_turns(args, sample, sampling_params):
    """Generate, append the TOOL ids (not trained), generate again: what a multi-turn function does."""
    append_generated(sample, await generate(sample.tokens, {**sampling_params, "max_new_tokens": 2}))
    append_masked(sample, TOOL, "<tool>")
    append_generated(sample, await generate(sample.tokens, sampling_params))
    return sample


class ScriptedEngine:
    """An engine request (relax.rollout.custom_generate.EngineRequest) answering the k-th request with the ids
    answers[k], each token's logprob -1 - k; records what it was sent."""

    def __init__(self, answers: list[list[int]], finish_reason: str = "stop"):
        self.answers, self.finish_reason, self.requests = answers, finish_reason, []

    async def __call__(self, input_ids, params):
        ids = self.answers[len(self.requests)]
        self.requests.append((input_ids, params))
        return Completion(ids, [-1.0 - len(self.requests) + 1] * len(ids), self.finish_reason, f"<{len(ids)} ids>")


def run_call(fn, engine, prompt_ids=PROMPT, label="7", so_far=None, keep_aborted=False) -> list[Completion]:
    prompt = Prompt(row=1, token_ids=list(prompt_ids), text="copy 7:", label=label)
    return asyncio.run(generate_samples(_as_custom(fn), "args", prompt, {"max_new_tokens": 8}, engine,
                                        so_far=so_far, keep_aborted=keep_aborted))


def run_sample(fn, engine, prompt_ids=PROMPT, label="7", **partial) -> Completion:
    """The one completion of a call that returned one sample (or failed); `partial`: run_call's so_far and
    keep_aborted."""
    (completion,) = run_call(fn, engine, prompt_ids, label, **partial)
    return completion


def _as_custom(fn) -> CustomGenerateFn:
    """A test's async function as the flag loads one (a CustomGenerateFn as it is)."""
    return fn if isinstance(fn, CustomGenerateFn) else CustomGenerateFn(fn, "tests:fn", takes_evaluation=False)


def test_a_two_turn_function_trains_its_sampled_tokens_only_with_the_engines_logprobs():
    engine = ScriptedEngine([[1, 2], [3]])
    completion = run_sample(two_turns, engine)
    assert completion.token_ids == [1, 2, *TOOL, 3] and completion.error is None
    assert completion.loss_mask == [1, 1, 0, 0, 1]
    assert completion.logprobs == [-1.0, -1.0, 0.0, 0.0, -2.0]
    assert completion.text == "<2 ids><tool><1 ids>" and completion.finish_reason == "stop"
    assert completion.reward is None  # the reward function scores it
    # each turn is sent the prompt and the response so far, as token ids
    assert [ids for ids, _ in engine.requests] == [PROMPT, PROMPT + [1, 2, *TOOL]]
    assert engine.requests[0][1]["max_new_tokens"] == 2


def test_the_sample_a_function_gets_holds_the_prompt_and_the_status_follows_the_last_turn():
    seen = []

    async def look(args, sample, sampling_params):
        seen.append((sample.prompt, sample.label, sample.tokens, sample.status, sample.response_length))
        append_generated(sample, await generate(sample.tokens, sampling_params))
        return [sample]  # a list of one sample is the sample

    completion = run_sample(look, ScriptedEngine([[4, 5]], finish_reason="length"))
    assert seen == [("copy 7:", "7", PROMPT, Sample.Status.PENDING, 0)]
    assert completion.finish_reason == "length" and completion.loss_mask == [1, 1]


def test_a_preset_reward_is_kept():
    async def scored(args, sample, sampling_params):
        sample = await two_turns(args, sample, sampling_params)
        sample.reward = 1
        return sample

    assert run_sample(scored, ScriptedEngine([[1], [2]])).reward == 1.0


def test_an_aborted_sample_comes_back_aborted_whatever_it_holds():
    async def aborts(args, sample, sampling_params):
        sample.tokens, sample.status = sample.tokens + [9], Sample.Status.ABORTED
        return sample

    completion = run_sample(aborts, ScriptedEngine([]))
    assert completion.finish_reason == "abort" and completion.token_ids == [] and completion.error is None


def test_a_sample_that_starts_from_its_own_prompt_ids_carries_them_and_its_response_after_them():
    async def rewrites_the_prompt(args, sample, sampling_params):
        sample.tokens = [4, 4] + sample.tokens  # slime's functions set tokens themselves: a system prompt before it
        return await two_turns(args, sample, sampling_params)

    engine = ScriptedEngine([[1, 2], [3]])
    completion = run_sample(rewrites_the_prompt, engine)
    assert completion.error is None and completion.prompt_ids == [4, 4, *PROMPT]
    assert completion.token_ids == [1, 2, *TOOL, 3] and completion.loss_mask == [1, 1, 0, 0, 1]
    assert completion.logprobs == [-1.0, -1.0, 0.0, 0.0, -2.0]
    assert engine.requests[0][0] == [4, 4, *PROMPT]
    assert run_sample(two_turns, ScriptedEngine([[1, 2], [3]])).prompt_ids is None  # the row's prompt ids


def _returning(value):
    async def fn(args, sample, sampling_params):
        return value(sample) if callable(value) else value
    return fn


def _with(**fields):
    def change(sample):
        for name, value in fields.items():
            setattr(sample, name, value)
        return sample
    return change


async def _raises(args, sample, sampling_params):
    raise KeyError("label")


@pytest.mark.parametrize("fn, reason", [
    (_raises, "--custom-generate-function-path tests:fn raised KeyError: 'label'"),
    (_returning(None), "returned NoneType, not a relax.rollout.custom_generate.Sample"),
    (_returning([]), "returned a list of 0 samples: return 1 to 16 samples per call"),
    (_returning(lambda s: [s] * 17), "returned a list of 17 samples: return 1 to 16 samples per call"),
    (_returning(lambda s: [s, s]), "sample 0 of the 2 it returned: returned a sample with status PENDING"),
    (_returning(lambda s: s), "returned a sample with status PENDING"),
    (_returning(_with(status=Sample.Status.FAILED)), "returned a sample with status FAILED"),
    (_returning(_with(status=Sample.Status.COMPLETED, tokens=[1, 2], response_length=2,
                      rollout_log_probs=[-1.0] * 2)), "its 2 tokens must hold the prompt's ids (at least one)"),
    (_returning(_with(status=Sample.Status.COMPLETED, tokens=PROMPT + [1] * 9, response_length=9,
                      rollout_log_probs=[-1.0] * 9)), "its response has 9 tokens, over its budget of 8"),
    (_returning(_with(status=Sample.Status.COMPLETED, tokens=PROMPT + [1], response_length=1)),
     "its rollout_log_probs are None: give the engine's logprob of each response token"),
    (_returning(_with(status=Sample.Status.COMPLETED, tokens=PROMPT + [1], response_length=1,
                      rollout_log_probs=[-1.0], reward={"acc": 1})), "its reward is dict, not a number"),
])
def test_a_sample_the_function_fails_or_misaligns_is_failed_naming_why(fn, reason):
    completion = run_sample(fn, ScriptedEngine([]))
    assert completion.finish_reason == "error" and completion.token_ids == []
    assert completion.error.startswith("--custom-generate-function-path tests:fn")
    assert reason in completion.error


def _finished(reward=None, status=Sample.Status.COMPLETED, **fields) -> Sample:
    """A sample a function built itself: one response token 9 after PROMPT."""
    return Sample("copy 7:", **{"tokens": PROMPT + [9], "response_length": 1, "rollout_log_probs": [-3.0],
                                "reward": reward, "status": status, **fields})


def test_a_call_that_fans_out_gives_a_completion_per_sample_each_checked_as_one_sample_is():
    async def fans_out(args, sample, sampling_params):
        return [await two_turns(args, sample, sampling_params), _finished(reward=0.5)]

    completions = run_call(fans_out, ScriptedEngine([[1, 2], [3]]))
    assert [c.token_ids for c in completions] == [[1, 2, *TOOL, 3], [9]]
    assert [c.loss_mask for c in completions] == [[1, 1, 0, 0, 1], None]
    assert [c.reward for c in completions] == [None, 0.5] and [c.error for c in completions] == [None, None]
    # a bad element fails the whole call, naming which one; an ABORTED one sends the call's prompt back
    (failed,) = run_call(_returning([_finished(), _finished(rollout_log_probs=[-1.0, -2.0])]), ScriptedEngine([]))
    assert failed.error == ("--custom-generate-function-path tests:fn: sample 1 of the 2 it returned: its "
                            "rollout_log_probs has 2 entries for 1 response tokens")
    (over,) = run_call(_returning([_finished(), _finished(tokens=PROMPT + [9] * 9, response_length=9,
                                                          rollout_log_probs=[-1.0] * 9)]), ScriptedEngine([]))
    assert "sample 1 of the 2 it returned: its response has 9 tokens, over its budget of 8" in over.error
    (aborted,) = run_call(_returning([_finished(), _finished(status=Sample.Status.ABORTED)]), ScriptedEngine([]))
    assert aborted.finish_reason == "abort" and aborted.error is None
    (one,) = run_call(_returning([_finished()] * 1), ScriptedEngine([]))  # a list of one is the sample
    assert one.token_ids == [9]


def test_append_keeps_the_fields_aligned_after_tokens_the_function_set_itself():
    sample = Sample("p", tokens=[7, 1, 2], response_length=2, rollout_log_probs=[-1.0, -2.0])  # no mask: all trained
    append_masked(sample, [3], "x")
    assert (sample.tokens, sample.loss_mask, sample.rollout_log_probs, sample.response_length) == (
        [7, 1, 2, 3], [1, 1, 0], [-1.0, -2.0, 0.0], 3
    )
    assert completion_of(_with(status=Sample.Status.COMPLETED)(sample), [7], budget=3).loss_mask == [1, 1, 0]
    with pytest.raises(ValueError, match="2 token ids but 1 logprobs"):
        append_generated(sample, Completion([1, 2], [-1.0], "stop", ""))
    with pytest.raises(ValueError, match="the sample has 1 response tokens but no rollout_log_probs"):
        append_masked(Sample("p", tokens=[7, 1], response_length=1), [3], "x")


def test_generate_outside_a_function_says_where_it_works():
    with pytest.raises(RuntimeError, match="reaches an engine only from a function that relax calls"):
        asyncio.run(generate([1], {}))


# --- a rollout of the function's samples: EngineWorker's groups, as collect_groups fills a step ------------------

class ScriptedWorker(EngineWorker):
    """An engine actor with the custom generate function `fn`, whose engine answers every request with `answer`
    (ids); records each request's seed."""

    def __init__(self, fn, answer=(1, 2), partial_rollout=False):
        self.aborts, self.answer, self.seeds, self.custom_groups = 0, list(answer), [], Counter()
        self.custom_generate = (_as_custom(fn), argparse.Namespace(partial_rollout=partial_rollout))
        self.chat_sessions = ChatSessions("the model", {}, "http://127.0.0.1:1")  # the function opens none
        self.server_args = SimpleNamespace(enable_priority_scheduling=True)  # as --partial-rollout turns it on
        self.priorities = []  # each request's, by its input ids

    def _live(self):
        return "the engine"

    def _run(self, coroutine):
        return asyncio.run(coroutine)

    async def generate_request(self, engine, request, params, priority):
        self.seeds.append(params["sampling_seed"])
        self.priorities.append((request, priority))
        return Completion(self.answer, [-0.5] * len(self.answer), "stop", "ab")


async def by_label(args, sample, sampling_params):
    """The samples of a prompt labelled "abort" come back ABORTED, of "fail" the first raises, of "scored" with a
    reward; the others are two_turns'."""
    if sample.label == "abort":
        sample.status = Sample.Status.ABORTED
        return sample
    if sample.label == "fail" and sampling_params["sampling_seed"] % 2 == 0:
        raise RuntimeError("no tool")
    sample = await two_turns(args, sample, sampling_params)
    if sample.label == "scored":
        sample.reward = 0.25
    return sample


class WorkerPool:
    """An engine pool (relax.rollout.rollout.EnginePool) over one ScriptedWorker: each group answered at submit."""

    weights_ahead = 0

    def __init__(self, worker):
        self.worker, self.done, self.aborts = worker, [], 0

    def submit(self, key, prompt, sampling, prefixes=None, source=None):
        self.done.append((key, self.worker.generate_group(prompt, sampling, prefixes, source)))

    def next_done(self):
        return self.done.pop(0)

    def abort(self):
        self.aborts += 1


def test_a_step_of_function_samples_keeps_preset_rewards_puts_aborted_prompts_back_and_counts_failures():
    labels = ["abort", "fail", "scored", "plain", "plain"]
    loader = PromptLoader([Prompt(i + 1, [100 + i], f"p{i}", label) for i, label in enumerate(labels)], shuffle=False)
    scored = []

    def reward(sample):
        scored.append(sample.label)
        return 1.0

    worker = ScriptedWorker(by_label)
    samples, metrics = collect_groups(
        WorkerPool(worker), loader, SamplingConfig(n=2, seed=0, max_new_tokens=8),
        RewardFn(reward, "r", per_batch=False, is_async=False), num_groups=2, chunk_size=1, dynamic_sampling=False,
        max_prompts=5,
    )
    assert [s.prompt.label for s in samples] == ["scored", "scored", "plain", "plain"]
    assert [s.reward for s in samples] == [0.25, 0.25, 1.0, 1.0] and scored == ["plain", "plain"]
    assert [s.loss_mask for s in samples] == [[1, 1, 0, 0, 1, 1]] * 4
    assert [s.response_logprobs for s in samples] == [[-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]] * 4
    assert metrics["rollout/failed_samples"] == 1 and metrics["rollout/failed_groups"] == 1
    assert metrics["rollout/function_aborted_samples"] == 2 and metrics["rollout/returned_prompts"] == 1
    assert loader.take(1)[0].label == "abort"  # back first for the next step
    # the k-th group's sample j is seeded 2k + j in each of its turns: the failing group's second sample (its first
    # raised before a request), then both samples of groups 2 and 3, two turns each
    assert sorted(worker.seeds) == [3, 3, 4, 4, 5, 5, 6, 6, 7, 7]


async def fans_out_by_label(args, sample, sampling_params):
    """A prompt labelled "plain": one sample per call, its reward the seed's parity; "fan": a second one beside it
    with reward 0.0 (the reward function gives the first 1.0); "fan_equal": the second with 1.0."""
    row_ids = list(sample.tokens)
    first = await two_turns(args, sample, sampling_params)
    if sample.label == "plain":
        first.reward = float(sampling_params["sampling_seed"] % 2)
        return first
    sibling = Sample(sample.prompt, tokens=row_ids + [9], response_length=1, rollout_log_probs=[-3.0],
                     reward=0.0 if sample.label == "fan" else 1.0, status=Sample.Status.COMPLETED)
    return [first, sibling]


def test_a_step_of_fanned_out_groups_counts_groups_not_samples_and_normalises_over_each_whole_group(tmp_path):
    labels = ["fan", "fan_equal", "plain"]
    loader = PromptLoader([Prompt(i + 1, [100 + i], f"p{i}", label) for i, label in enumerate(labels)], shuffle=False)
    samples, metrics = collect_groups(
        WorkerPool(ScriptedWorker(fans_out_by_label)), loader, SamplingConfig(n=2, seed=0, max_new_tokens=8),
        RewardFn(lambda sample: 1.0, "r", per_batch=False, is_async=False), num_groups=2, chunk_size=1,
        dynamic_sampling=True, max_prompts=3,
    )
    # "fan": 2 calls x 2 samples, kept; "fan_equal": its 4 rewards equal, dropped; "plain": 2 samples, kept
    assert [s.prompt.label for s in samples] == ["fan"] * 4 + ["plain"] * 2
    assert [s.group_size for s in samples] == [4] * 4 + [2] * 2 and group_sizes(samples, 2) == [4, 2]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert [s.response_token_ids[-1] for s in samples[:4]] == [2, 9, 2, 9]  # call by call, each call's in order
    assert metrics["rollout/fan_out_samples"] == 2 and metrics["rollout/dropped_groups"] == 1
    assert metrics["rollout/kept_groups"] == 2
    # GRPO over each whole group: [1, 0, 1, 0] has mean 0.5 and unbiased std sqrt(1/3); [0, 1] mean 0.5, std
    # sqrt(1/2)
    algorithm = AlgorithmSettings(advantage_estimator="grpo", normalize_advantages_by_std=True, group_size=2,
                                  global_batch_size=2, uses_reference=False)
    batch = rollout_batch(samples, algorithm)
    first_tokens = [advantages[0].item() for advantages in batch.advantages]
    wide, pair = 0.5 / (1 / 3) ** 0.5, 0.5 / 0.5 ** 0.5
    assert first_tokens == pytest.approx([wide, -wide, wide, -wide, -pair, pair], abs=1e-5)
    # the step keeps its 2 optimizer steps of --global-batch-size 2 nominally; they train 3 samples each
    assert optimizer_step_sizes(len(samples), 2, 2, algorithm.global_batch_size) == [3, 3]
    # --save-rollout-data keeps each group's size; a replay gets the same groups
    pattern = str(tmp_path / "step_{step}.jsonl")
    header = json.loads(save_rollout_data(pattern, 0, samples, 2).read_text().splitlines()[0])
    assert header["group_sizes"] == [4, 2] and header["samples_per_prompt"] == 2
    replayed = load_rollout_data(pattern, 0, num_groups=2, samples_per_prompt=2)
    assert [s.group_size for s in replayed] == [4] * 4 + [2] * 2
    assert [(s.response_token_ids, s.reward) for s in replayed] == [(s.response_token_ids, s.reward) for s in samples]
    assert [a.tolist() for a in rollout_batch(replayed, algorithm).advantages] == [a.tolist() for a in batch.advantages]


def test_a_step_trains_the_samples_of_a_function_that_rewrites_the_prompt_on_their_own_prompt_ids():
    async def with_a_system_prompt(args, sample, sampling_params):
        sample.tokens = [4, 4] + sample.tokens
        return await two_turns(args, sample, sampling_params)

    prompts = [Prompt(1, [100], "p0"), Prompt(2, [101], "p1")]
    samples, metrics = collect_groups(
        WorkerPool(ScriptedWorker(with_a_system_prompt)), PromptLoader(prompts, shuffle=False),
        SamplingConfig(n=2, seed=0, max_new_tokens=8), RewardFn(lambda sample: 1.0, "r", per_batch=False,
                                                                   is_async=False),
        num_groups=2, chunk_size=2, dynamic_sampling=False, max_prompts=2,
    )
    assert [s.prompt_ids for s in samples] == [[4, 4, 100]] * 2 + [[4, 4, 101]] * 2
    assert [s.prompt.token_ids for s in samples] == [[100]] * 2 + [[101]] * 2  # the data rows, as they were
    assert [s.response_token_ids for s in samples] == [[1, 2, *TOOL, 1, 2]] * 4
    assert reward_and_length_metrics(samples)["rollout/prompt_tokens"] == 12  # each sample's own prompt
    # An evaluation's samples (samples_of) carry them too
    (evaluated,) = samples_of(prompts[:1], [[Completion([5], [-1.0], "stop", "", prompt_ids=[4, 100])]])
    assert evaluated.prompt_ids == [4, 100] and evaluated.prompt.token_ids == [100]


def test_an_evaluations_group_is_the_functions_told_so_and_an_aborted_sample_fails_there():
    told = []

    async def for_eval(args, sample, sampling_params, evaluation=False):
        told.append(evaluation)
        sample.status = Sample.Status.ABORTED if sample.label == "abort" else Sample.Status.COMPLETED
        sample.rollout_log_probs = []
        return sample

    worker = ScriptedWorker(CustomGenerateFn(for_eval, "tests:fn", takes_evaluation=True))
    (done,) = worker.generate_group([5], SamplingConfig(n=1), None, Prompt(1, [5], "p"), evaluation=True)
    (aborted,) = worker.generate_group([5], SamplingConfig(n=1), None, Prompt(1, [5], "p", "abort"), evaluation=True)
    (returned,) = worker.generate_group([5], SamplingConfig(n=1), None, Prompt(1, [5], "p", "abort"))
    assert told == [True, True, False]
    assert done.finish_reason == "stop" and done.token_ids == []
    assert "returned a sample with status ABORTED in an evaluation, which puts no prompt back" in aborted.error
    assert returned.finish_reason == "abort" and returned.error is None  # a rollout's: its prompt goes back


# --- partial rollout: a sample the function returned ABORTED, kept and continued by a later step's call ---------

def _so_far(**fields) -> ResponseSoFar:
    """What an earlier step's call left ABORTED: the response [1, 2] then TOOL (masked), sampled in step 3."""
    return ResponseSoFar(**{"token_ids": [1, 2, *TOOL], "logprobs": [-1.0, -1.0, 0.0, 0.0], "steps": [3] * 4,
                            "text": "<2 ids><tool>", "loss_mask": [1, 1, 0, 0], "metadata": {"turn": 1}, **fields})


async def one_turn(args, sample, sampling_params):
    """The module docstring's function, which continues a sample as it starts one: a request for what the budget
    has left after sample.tokens."""
    left = tokens_left(sample, sampling_params)
    append_generated(sample, await generate(sample.tokens, {**sampling_params, "max_new_tokens": left}))
    return sample


async def aborted_after_a_turn(args, sample, sampling_params):
    """One turn that the engine aborts (the step's batch is full), noted in the sample's metadata."""
    append_generated(sample, await generate(sample.tokens, sampling_params))
    sample.metadata["turn"] = 1
    return sample


def test_an_aborted_sample_is_kept_with_what_it_holds_under_partial_rollout():
    completion = run_sample(aborted_after_a_turn, ScriptedEngine([[1, 2]], "abort"), keep_aborted=True)
    assert completion.finish_reason == "abort" and completion.error is None and not completion.restarted
    assert (completion.token_ids, completion.logprobs, completion.loss_mask) == ([1, 2], [-1.0, -1.0], [1, 1])
    assert completion.text == "<2 ids>" and completion.metadata == {"turn": 1} and completion.reward is None
    # without partial rollout nothing is kept; with it, a sample with no response keeps nothing to continue
    bare = run_sample(aborted_after_a_turn, ScriptedEngine([[1, 2]], "abort"))
    assert (bare.finish_reason, bare.token_ids, bare.metadata, bare.restarted) == ("abort", [], None, False)
    empty = run_sample(aborted_after_a_turn, ScriptedEngine([[]], "abort"), keep_aborted=True)
    assert (empty.finish_reason, empty.token_ids, empty.metadata, empty.restarted) == ("abort", [], None, False)

    async def keeps_a_set(args, sample, sampling_params):
        sample = await aborted_after_a_turn(args, sample, sampling_params)
        sample.metadata["seen"] = {1}
        return sample

    failed = run_sample(keeps_a_set, ScriptedEngine([[1, 2]], "abort"), keep_aborted=True)
    assert failed.finish_reason == "error" and "its metadata cannot be kept for a later step" in failed.error
    misaligned = run_sample(_returning(_with(status=Sample.Status.ABORTED, tokens=PROMPT + [1], response_length=1,
                                             rollout_log_probs=[-1.0, -1.0])), ScriptedEngine([]), keep_aborted=True)
    assert "its rollout_log_probs has 2 entries for 1 response tokens" in misaligned.error


def test_a_continued_sample_comes_as_the_function_left_it_and_gives_back_what_it_added():
    seen = []

    async def look(args, sample, sampling_params):
        seen.append((sample.tokens, sample.response, sample.response_length, sample.loss_mask,
                     sample.rollout_log_probs, sample.metadata, sample.status, sampling_params["max_new_tokens"]))
        return await one_turn(args, sample, sampling_params)

    so_far, engine = _so_far(), ScriptedEngine([[3]])
    completion = run_sample(look, engine, so_far=so_far, keep_aborted=True)
    assert seen == [(PROMPT + [1, 2, *TOOL], "<2 ids><tool>", 4, [1, 1, 0, 0], [-1.0, -1.0, 0.0, 0.0], {"turn": 1},
                     Sample.Status.ABORTED, 8)]
    assert engine.requests == [(PROMPT + [1, 2, *TOOL], {"max_new_tokens": 4})]  # what the budget has left
    assert (completion.token_ids, completion.logprobs, completion.loss_mask) == ([3], [-1.0], [1])
    assert completion.text == "<1 ids>" and completion.finish_reason == "stop" and completion.prompt_ids is None
    assert so_far == _so_far()  # the function's changes leave the kept response as it was
    assert so_far.extended(completion, 5).steps == [3, 3, 3, 3, 5]  # each token keeps the step that sampled it
    # a sample of its own prompt ids goes on after them; aborted again, it comes back with what it added
    own, engine = _so_far(prompt_ids=[4, *PROMPT]), ScriptedEngine([[3]], "abort")
    again = run_sample(one_turn, engine, so_far=own, keep_aborted=True)
    assert engine.requests[0][0] == [4, *PROMPT, 1, 2, *TOOL] and again.prompt_ids == [4, *PROMPT]
    assert (again.finish_reason, again.token_ids, again.metadata) == ("abort", [3], {"turn": 1})


@pytest.mark.parametrize("change, changed", [
    (_with(tokens=PROMPT + [9, 2, *TOOL]), "but changed its tokens"),
    (_with(loss_mask=[1, 1, 1, 1]), "but changed its loss_mask"),
    (_with(loss_mask=None), "but changed its loss_mask"),  # None: every token trained
    (_with(rollout_log_probs=[-2.0, -1.0, 0.0, 0.0]), "but changed its rollout_log_probs"),
    (_with(response="<tool>"), "but changed its response"),
    (_with(tokens=[4, *PROMPT, 1, 2, *TOOL]), "it continues a sample of 3 prompt ids but its prompt changed"),
    (_with(tokens=PROMPT + [1, 2, 50], response_length=3, loss_mask=[1, 1, 0], rollout_log_probs=[-1.0, -1.0, 0.0]),
     "it continues a response of 4 tokens but changed its tokens, loss_mask, rollout_log_probs"),
])
def test_a_continued_sample_that_changed_its_response_so_far_fails_naming_what(change, changed):
    async def changes(args, sample, sampling_params):
        change(sample).status = Sample.Status.COMPLETED
        return sample

    completion = run_sample(changes, ScriptedEngine([]), so_far=_so_far(), keep_aborted=True)
    assert completion.finish_reason == "error" and changed in completion.error
    assert "a continued sample keeps the prompt and the response it was given" in completion.error


def test_a_call_that_drops_its_sample_or_fans_out_around_an_aborted_one_starts_again_counted():
    async def drops_it(args, sample, sampling_params):
        return Sample(sample.prompt, tokens=list(PROMPT), status=Sample.Status.ABORTED)

    (dropped,) = run_call(drops_it, ScriptedEngine([]), so_far=_so_far(), keep_aborted=True)
    assert (dropped.finish_reason, dropped.token_ids, dropped.restarted) == ("abort", [], True)
    assert _so_far().extended(dropped, 5) == ResponseSoFar()  # the rollout's response starts again

    async def fans_out(args, sample, sampling_params):
        return [await one_turn(args, sample, sampling_params), _finished()]

    (continued,) = run_call(fans_out, ScriptedEngine([[3]]), so_far=_so_far(), keep_aborted=True)
    assert (continued.finish_reason, continued.token_ids, continued.restarted) == ("abort", [], True)
    # a new call's fan-out with an ABORTED sample: nothing kept, counted where that sample had a response
    fan_out = _returning([_finished(), _finished(status=Sample.Status.ABORTED)])
    (aborted,) = run_call(fan_out, ScriptedEngine([]), keep_aborted=True)
    assert (aborted.finish_reason, aborted.token_ids, aborted.restarted) == ("abort", [], True)
    (not_kept,) = run_call(fan_out, ScriptedEngine([]))  # without partial rollout nothing is ever kept
    assert not not_kept.restarted


def _take_and_keep(loader, worker, step, partial=Partial(None), num_groups=1, max_prompts=1):
    """One step's collect_groups of num_groups groups of 2 samples over `worker`, every sample rewarded 1.0."""
    return collect_groups(
        WorkerPool(worker), loader, SamplingConfig(n=2, seed=0, max_new_tokens=8),
        RewardFn(lambda sample: 1.0, "r", per_batch=False, is_async=False), num_groups=num_groups, chunk_size=1,
        dynamic_sampling=False, max_prompts=max_prompts, step=step, partial=partial,
    )


def test_a_function_sample_aborted_in_one_step_is_saved_and_continued_by_the_next_ahead_of_new_requests():
    continued = []

    async def slow_then_done(args, sample, sampling_params):
        """A "slow" prompt's new sample: its first turn comes back ABORTED (as when the step's batch is full),
        noted in its metadata. Continued: the TOOL ids and a second turn. Other prompts: two_turns'."""
        if sample.label == "slow" and sample.status is Sample.Status.PENDING:
            sample = await aborted_after_a_turn(args, sample, sampling_params)
            sample.status = Sample.Status.ABORTED
            return sample
        if sample.status is Sample.Status.ABORTED:
            continued.append((sample.metadata, sample.response_length))
            append_masked(sample, TOOL, "<tool>")
            return await one_turn(args, sample, sampling_params)
        return await two_turns(args, sample, sampling_params)

    prompts = [Prompt(1, [100], "p0", "slow"), Prompt(2, [101], "p1", "plain"), Prompt(3, [102], "p2", "plain")]
    loader = PromptLoader(prompts, shuffle=False)
    samples, metrics = _take_and_keep(loader, ScriptedWorker(slow_then_done, partial_rollout=True), step=0,
                                      max_prompts=2)
    assert [s.prompt.label for s in samples] == ["plain", "plain"]
    assert metrics["rollout/function_aborted_samples"] == 2 and metrics["rollout/partial_carried_tokens"] == 4
    # a checkpoint saves the loader as JSON, and the resumed run continues the group
    resumed = PromptLoader.from_state_dict(prompts, json.loads(json.dumps(loader.state_dict())))
    worker = ScriptedWorker(slow_then_done, partial_rollout=True)
    samples, metrics = _take_and_keep(resumed, worker, step=1)
    assert continued == [({"turn": 1}, 2)] * 2
    assert [s.prompt.label for s in samples] == ["slow", "slow"]
    assert [s.response_token_ids for s in samples] == [[1, 2, *TOOL, 1, 2]] * 2
    assert [s.loss_mask for s in samples] == [[1, 1, 0, 0, 1, 1]] * 2
    assert [s.response_steps for s in samples] == [[0, 0, 1, 1, 1, 1]] * 2  # the tokens' ages
    assert [s.response_logprobs for s in samples] == [[-0.5, -0.5, 0.0, 0.0, -0.5, -0.5]] * 2
    assert metrics["rollout/partial_resumed_samples"] == 2 and metrics["rollout/partial_oldest_token_age"] == 1
    assert metrics["rollout/partial_old_token_fraction"] == 4 / 12 and metrics["rollout/partial_restarted_calls"] == 0
    assert worker.priorities == [([100, 1, 2, *TOOL], CONTINUED_RESPONSE_PRIORITY)] * 2  # ahead of new requests
    assert sorted(worker.seeds) == [0, 1]  # the step's first group: its calls seeded 0 and 1


def test_a_kept_function_sample_older_than_max_staleness_is_called_anew_from_the_prompt():
    async def aborts_new_samples(args, sample, sampling_params):
        sample = await (aborted_after_a_turn if sample.label == "slow" else two_turns)(args, sample, sampling_params)
        if sample.label == "slow":
            sample.status = Sample.Status.ABORTED
        return sample

    prompts = [Prompt(1, [100], "p0", "slow"), Prompt(2, [101], "p1", "plain"), Prompt(3, [102], "p2", "plain")]
    loader = PromptLoader(prompts, shuffle=False)
    worker = ScriptedWorker(aborts_new_samples, partial_rollout=True)
    _take_and_keep(loader, worker, step=0, max_prompts=2)
    worker.priorities.clear()
    samples, metrics = _take_and_keep(loader, worker, step=2, partial=Partial(max_staleness=1), max_prompts=2)
    assert metrics["rollout/partial_stale_samples"] == 2 and metrics["rollout/function_aborted_samples"] == 2
    assert [priority for _, priority in worker.priorities[:2]] == [None, None]  # new samples: the prompt alone
    assert [ids for ids, _ in worker.priorities[:2]] == [[100], [100]]


def test_a_groups_fanned_out_samples_are_kept_with_it_and_its_continued_call_keeps_its_place():
    async def fan_and_slow(args, sample, sampling_params):
        """Call 0 of a new group: ABORTED after a turn; continued, done. Call 1: a sample and a sibling, its
        reward preset."""
        if sample.status is Sample.Status.ABORTED:
            return await one_turn(args, sample, sampling_params)
        if sampling_params["sampling_seed"] % 2 == 0:
            sample = await aborted_after_a_turn(args, sample, sampling_params)
            sample.status = Sample.Status.ABORTED
            return sample
        sibling = Sample(sample.prompt, tokens=[*sample.tokens, 9], response_length=1, rollout_log_probs=[-3.0],
                         reward=0.0, status=Sample.Status.COMPLETED)
        return [await two_turns(args, sample, sampling_params), sibling]

    prompts = [Prompt(1, [100], "p0"), Prompt(2, [101], "p1")]
    loader = PromptLoader(prompts, shuffle=False)
    worker = ScriptedWorker(fan_and_slow, partial_rollout=True)
    with pytest.raises(FillError):  # every new group comes back with an ABORTED sample
        _take_and_keep(loader, worker, step=0, max_prompts=1)
    resumed = PromptLoader.from_state_dict(prompts, json.loads(json.dumps(loader.state_dict())))
    samples, metrics = _take_and_keep(resumed, worker, step=1)
    assert [s.response_token_ids for s in samples] == [[1, 2, 1, 2], [1, 2, *TOOL, 1, 2], [9]]
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0] and [s.group_size for s in samples] == [3] * 3
    assert [s.response_steps for s in samples] == [[0, 0, 1, 1], [0] * 6, [0]]  # the finished ones: step 0's


def test_a_continued_groups_new_call_that_fans_out_adds_its_other_samples_after_the_groups_responses():
    new_calls = []

    async def first_aborts_then_the_second_fans_out(args, sample, sampling_params):
        """Step 0 (the first two new calls): call 0 ABORTED after a turn, call 1 ABORTED with nothing (it starts
        again). Step 1: call 0's sample continued; call 1 anew, a sample and a sibling."""
        if sample.status is Sample.Status.ABORTED:
            return await one_turn(args, sample, sampling_params)
        new_calls.append(sampling_params["sampling_seed"])
        if len(new_calls) <= 2:
            if sampling_params["sampling_seed"] % 2 == 0:
                sample = await aborted_after_a_turn(args, sample, sampling_params)
            sample.status = Sample.Status.ABORTED
            return sample
        sibling = Sample(sample.prompt, tokens=[*sample.tokens, 9], response_length=1, rollout_log_probs=[-3.0],
                         status=Sample.Status.COMPLETED)
        return [await one_turn(args, sample, sampling_params), sibling]

    loader = PromptLoader([Prompt(1, [100], "p0")], shuffle=False)
    worker = ScriptedWorker(first_aborts_then_the_second_fans_out, partial_rollout=True)
    with pytest.raises(FillError):  # its one group comes back with ABORTED samples, put back
        _take_and_keep(loader, worker, step=0)
    samples, metrics = _take_and_keep(loader, worker, step=1)
    assert new_calls == [0, 1, 1]  # step 1 calls anew only the call whose sample kept nothing, seeded as the second
    assert [s.response_token_ids for s in samples] == [[1, 2, 1, 2], [1, 2], [9]]  # call 0's, call 1's two
    assert [s.response_steps for s in samples] == [[0, 0, 1, 1], None, None] and samples[0].group_size == 3
    assert metrics["rollout/fan_out_samples"] == 1 and metrics["rollout/partial_restarted_calls"] == 0
