"""relax.rollout.rollout with a scripted `generate` or engine pool in place of the engines (the real engine:
tests/e2e/test_engine.py; the Ray dispatch: tests/unit/test_colocation.py; the loop's collect_rollout around it:
tests/unit/test_dynamic_sampling.py)."""

import asyncio
import json

import pytest

from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import AllSamplesFailed, FillError, group_by_prompt
from relax.rollout.multi_turn import multi_turn_metrics
from relax.rollout.partial import GroupSoFar, PartialStats, ResponseSoFar
from relax.rollout.rewards import RewardFn, load_reward_fn
from relax.rollout.tool_calls import ToolUse
from relax.rollout.rollout import (
    STEP_SEED_SPAN,
    Partial,
    collect_groups,
    generate_and_score,
    reward_and_length_metrics,
    samples_of_group,
    take_prompts,
)


def scripted_completion(text: str, sampling: SamplingConfig) -> Completion:
    """A response `text` (one token per character), or with "refused: why" a request the engine refused."""
    if text.startswith("refused: "):
        return Completion.refused(text.removeprefix("refused: "))
    return Completion(token_ids=list(range(len(text))), logprobs=[-1.0] * len(text),
                      finish_reason="length" if len(text) >= sampling.max_new_tokens else "stop", text=text)


class ScriptedPool:
    """An engine pool (relax.rollout.rollout.EnginePool) answering prompt [i] with the texts script[i], as
    ScriptedGenerate does (a continued response, partial rollout: its requests' texts, the first len(prefixes)).
    Groups complete in submission order, but those of the prompts in `slow`, which complete only once aborted
    (finish_reason "abort", one token 7 each). Records each submission's (prompt, seed) and its prefixes."""

    weights_ahead = 0  # its engines' weights are those of the rollout's step (a test may set it)

    def __init__(self, script, slow=()):
        self.script, self.slow = script, set(slow)
        self.submitted: list[tuple[int, int | None]] = []
        self.prefixes: list[list[ResponseSoFar] | None] = []
        self.in_flight: dict[int, tuple[int, SamplingConfig, int]] = {}
        self.aborts = 0

    def submit(self, key, prompt, sampling, prefixes=None, source=None):
        self.submitted.append((prompt[0], sampling.seed))
        self.prefixes.append(prefixes)
        self.in_flight[key] = (prompt[0], sampling, sampling.n if prefixes is None else len(prefixes))

    def next_done(self):
        ready = [key for key, (prompt, *_) in self.in_flight.items() if prompt not in self.slow or self.aborts]
        assert ready, "the rollout waits for a group that ends only when aborted"
        key = min(ready)
        prompt, sampling, requests = self.in_flight.pop(key)
        if prompt in self.slow:
            return key, [Completion([7], [-1.0], "abort", "x") for _ in range(requests)]
        return key, [scripted_completion(text, sampling) for text in self.script[prompt][:requests]]

    def abort(self):
        self.aborts += 1


def collect(pool, loader, num_groups, chunk_size=None, dynamic_sampling=False, max_prompts=100, n=2, seed=5,
            partial=None, step=0):
    return collect_groups(pool, loader, SamplingConfig(n=n, seed=seed), load_reward_fn("exact_match"),
                          num_groups=num_groups, chunk_size=chunk_size or num_groups,
                          dynamic_sampling=dynamic_sampling, max_prompts=max_prompts, step=step, partial=partial)


class ScriptedGenerate:
    """Answers prompt [i] with the texts script[i] (one per sample; a text "refused: why" is a request the engine
    refused with that error); records each call's prompts and seed."""

    def __init__(self, script):
        self.script = script
        self.calls = []

    def __call__(self, prompts, sampling):
        self.calls.append(([prompt.token_ids[0] for prompt in prompts], sampling.seed))
        return [[scripted_completion(text, sampling) for text in self.script[prompt.token_ids[0]]]
                for prompt in prompts]


def prompts(count):
    return [Prompt(row=i + 1, token_ids=[i], text=f"copy {i}:", label=str(i)) for i in range(count)]


def test_samples_come_scored_prompt_by_prompt_with_their_metrics():
    generate = ScriptedGenerate({0: ["0", "1"], 1: ["1", "1x"]})
    sampling = SamplingConfig(n=2, max_new_tokens=2)
    samples = generate_and_score(generate, prompts(2), sampling, load_reward_fn("exact_match"))
    groups = group_by_prompt(samples, 2)
    assert [g.prompt.label for g in groups] == ["0", "1"]
    assert [g.rewards for g in groups] == [[1.0, 0.0], [1.0, 0.0]]
    assert [s.response_text for s in samples] == ["0", "1", "1", "1x"]
    assert groups[1].samples[1].response_logprobs == [-1.0, -1.0]
    assert [s.loss_mask for s in samples] == [[1], [1], [1], [1, 1]]  # every response token trained
    metrics = reward_and_length_metrics(samples)
    assert metrics["rollout/reward_mean"] == 0.5 and metrics["rollout/reward_std"] == pytest.approx(0.57735, abs=1e-5)
    assert metrics["rollout/response_length_mean"] == 1.25 and metrics["rollout/response_length_max"] == 2
    assert metrics["rollout/truncated_fraction"] == 0.25 and metrics["rollout/reward_failures"] == 0
    assert (metrics["rollout/response_tokens"], metrics["rollout/prompt_tokens"]) == (5, 4)
    assert generate.calls == [([0, 1], None)]  # one batched call


def test_a_generate_that_loses_a_prompt_is_an_error():
    generate = ScriptedGenerate({0: ["0"], 1: ["1"]})
    with pytest.raises(ValueError, match="zip"):
        generate_and_score(lambda prompts, sampling: generate(prompts, sampling)[:1], prompts(2), SamplingConfig(n=1),
                           load_reward_fn("exact_match"))


def test_dynamic_sampling_refills_from_the_loader_with_new_seeds_for_each_prompt():
    # prompts 0 and 2 give all-equal rewards and are dropped; 1 and 3 are kept
    pool = ScriptedPool({0: ["0", "0"], 1: ["1", "2"], 2: ["5", "6"], 3: ["3", "x"]})
    loader = PromptLoader(prompts(4), shuffle=False)
    samples, metrics = collect(pool, loader, num_groups=2, chunk_size=2, dynamic_sampling=True)
    assert [s.prompt.label for s in samples] == ["1", "1", "3", "3"]
    # request j of the k-th prompt submitted: seed + k * n + j; a chunk whenever fewer are in flight than needed
    assert pool.submitted == [(0, 5), (1, 7), (2, 9), (3, 11)] and pool.aborts == 0
    assert metrics["rollout/dropped_groups"] == 2 and metrics["rollout/submitted_groups"] == 4
    assert metrics["rollout/kept_groups"] == 2 and metrics["rollout/generated_groups"] == 4
    assert metrics["rollout/informative_group_fraction"] == 0.5


def test_without_over_sampling_the_batch_is_the_next_prompts_with_the_steps_seeds():
    pool = ScriptedPool({i: ["1", "1"] for i in range(5)})  # equal rewards: kept without dynamic sampling
    loader = PromptLoader(prompts(5), shuffle=False)
    samples, metrics = collect(pool, loader, num_groups=3, n=2, seed=100)
    assert [s.prompt.row for s in samples] == [1, 1, 2, 2, 3, 3]
    assert pool.submitted == [(0, 100), (1, 102), (2, 104)] and pool.aborts == 0
    assert metrics == {"rollout/failed_samples": 0, "rollout/failed_groups": 0, "rollout/submitted_groups": 3,
                       "rollout/aborted_groups": 0, "rollout/returned_prompts": 0,
                       "rollout/informative_group_fraction": 0.0}  # no group's rewards differ
    assert [p.row for p in loader.take(2)] == [4, 5]


def test_over_sampling_keeps_the_first_groups_to_complete_in_submission_order_and_puts_the_rest_back():
    # of 4 prompts in flight for 2 groups, 0 and 2 are the long tail: 1 and 3 complete first and are the batch
    pool = ScriptedPool({i: [str(i), "x"] for i in range(6)}, slow={0, 2})
    loader = PromptLoader(prompts(6), shuffle=False)
    samples, metrics = collect(pool, loader, num_groups=2, chunk_size=4)
    assert [s.prompt.label for s in samples] == ["1", "1", "3", "3"]
    assert pool.submitted == [(0, 5), (1, 7), (2, 9), (3, 11)] and pool.aborts == 1 and not pool.in_flight
    assert (metrics["rollout/submitted_groups"], metrics["rollout/aborted_groups"]) == (4, 2)
    assert metrics["rollout/returned_prompts"] == 2
    assert metrics["rollout/informative_group_fraction"] == 1.0  # one right and one wrong answer in each
    # nothing lost: the aborted prompts come first in the next step, then the stream goes on
    assert [p.label for p in loader.take(3)] == ["0", "2", "4"]


def test_partial_rollout_puts_aborted_groups_back_with_their_tokens_and_a_later_step_continues_them():
    pool = ScriptedPool({i: [str(i), "x"] for i in range(6)}, slow={0, 2})
    loader = PromptLoader(prompts(6), shuffle=False)
    collect(pool, loader, num_groups=2, chunk_size=4, partial=Partial(max_staleness=None), step=3)
    state = json.loads(json.dumps(loader.state_dict()))  # a checkpoint's: plain JSON, the tokens with it
    assert state["put_back"] == [0, 2]
    assert state["put_back_progress"][0]["responses"][0] == {
        "token_ids": [7], "logprobs": [-1.0], "steps": [3], "finish_reason": "abort", "text": "x", "loss_mask": None,
        "tool_use": None,
    }
    resumed = PromptLoader.from_state_dict(prompts(6), state)
    pool.slow.clear()
    samples, metrics = collect(pool, resumed, num_groups=2, chunk_size=2, partial=Partial(max_staleness=None),
                               step=4)
    continued = [[response.token_ids for response in prefixes] for prefixes in pool.prefixes[-2:]]
    assert continued == [[[7], [7]], [[7], [7]]]  # each request continues its response
    assert pool.submitted[-2:] == [(0, 5), (2, 7)]  # the step's seeds
    assert [s.response_token_ids for s in samples[:2]] == [[7, 0], [7, 0]]  # the tokens so far, then the new
    assert [s.response_text for s in samples[:2]] == ["x0", "xx"] and [s.reward for s in samples[:2]] == [0.0, 0.0]
    assert samples[0].response_steps == [3, 4] and samples[0].response_logprobs == [-1.0, -1.0]
    assert metrics["rollout/partial_resumed_samples"] == 4 and metrics["rollout/partial_oldest_token_age"] == 1
    assert metrics["rollout/partial_old_token_fraction"] == 0.5 and metrics["rollout/partial_stale_samples"] == 0


def test_tokens_of_weights_a_step_ahead_of_the_rollouts_are_recorded_as_the_next_steps():
    """--no-colocate: a restart made the rollout of step 3 wait for the step's training and push its weights, so its
    tokens are of the policy step 4's rollout samples with; taken again in step 4 they are that step's own."""
    pool = ScriptedPool({i: [str(i), "x"] for i in range(6)}, slow={0, 2})
    loader = PromptLoader(prompts(6), shuffle=False)
    pool.weights_ahead = 1
    collect(pool, loader, num_groups=2, chunk_size=4, partial=Partial(max_staleness=0), step=3)
    assert json.loads(json.dumps(loader.state_dict()))["put_back_progress"][0]["responses"][0]["steps"] == [4]
    pool.slow.clear()
    pool.weights_ahead = 0
    samples, metrics = collect(pool, loader, num_groups=2, chunk_size=2, partial=Partial(max_staleness=0), step=4)
    assert [s.response_token_ids for s in samples[:2]] == [[7, 0], [7, 0]]  # continued: not stale
    assert samples[0].response_steps is None  # no token of an earlier policy
    assert metrics["rollout/partial_oldest_token_age"] == 0 and metrics["rollout/partial_old_token_fraction"] == 0
    assert metrics["rollout/partial_stale_samples"] == 0


def test_partial_rollout_starts_again_responses_older_than_the_staleness_bound():
    pool = ScriptedPool({i: [str(i), "x"] for i in range(4)}, slow={0})
    loader = PromptLoader(prompts(4), shuffle=False)
    collect(pool, loader, num_groups=1, chunk_size=2, partial=Partial(max_staleness=1), step=0)
    pool.slow.clear()
    samples, metrics = collect(pool, loader, num_groups=1, partial=Partial(max_staleness=1), step=2)
    assert pool.prefixes[-1] is None and samples[0].response_token_ids == [0]  # generated anew from the prompt
    assert samples[0].response_steps is None
    assert metrics["rollout/partial_stale_samples"] == 2 and metrics["rollout/partial_resumed_samples"] == 0


def test_a_group_of_finished_and_aborted_responses_continues_only_the_aborted_ones():
    so_far = GroupSoFar([ResponseSoFar([1, 2], [-0.1, -0.2], [0, 0], "stop", "ab"), ResponseSoFar([3], [-0.3], [0]),
                         ResponseSoFar([4, 5, 6], [-0.4] * 3, [0] * 3), ResponseSoFar()])
    kept = so_far.copy()
    assert so_far.to_continue(budget=3) == [1, 3]  # the third has its whole budget: complete, by length
    assert so_far.responses[2].finish_reason == "length" and kept.responses[2].finish_reason == "abort"
    refused = so_far.responses[1].extended(Completion.refused("E"), step=1)
    assert (refused.token_ids, refused.error) == ([3], "E")
    assert refused.to_continue_later() == ResponseSoFar([3], [-0.3], [0])  # goes on from its tokens later
    assert GroupSoFar.from_state_dict(so_far.state_dict()) == so_far


def test_a_custom_generate_functions_response_keeps_its_prompt_and_metadata_until_its_call_restarts_it():
    kept = Completion([7, 8], [-0.7, -0.8], "abort", "x", loss_mask=[1, 0], prompt_ids=[4, 4],
                      metadata={"turn": 1})
    aborted = ResponseSoFar().extended(kept, step=3).to_continue_later()
    assert (aborted.prompt_ids, aborted.metadata, aborted.steps) == ([4, 4], {"turn": 1}, [3, 3])
    refused = aborted.extended(Completion.refused("E"), step=4).to_continue_later()
    assert refused == aborted  # a refused call changes nothing: a later step continues it as it was
    done = aborted.extended(Completion([9], [-0.9], "stop", "y", loss_mask=[1], prompt_ids=[4, 4], reward=1.0), 4)
    assert (done.token_ids, done.steps, done.reward, done.metadata) == ([7, 8, 9], [3, 3, 4], 1.0, None)
    assert aborted.extended(Completion.aborted(restarted=True), step=4) == ResponseSoFar()
    # the metrics count the calls restarted
    stats = PartialStats(restarted_calls=2)
    assert stats.metrics([], tokens=1, step=0)["rollout/partial_restarted_calls"] == 2


def test_a_continued_multi_turn_response_is_one_sample_with_its_whole_mask_and_its_turns_counted_once():
    """--tools with partial rollout: a response aborted at the start of its second turn (after a tool turn, ids 8 9
    appended) and finished in the next step; each completion counts all the response's turns."""
    aborted = Completion([7, 8, 9], [-0.7, 0.0, 0.0], "abort", "x", loss_mask=[1, 0, 0],
                         tool_use=ToolUse(turns=2, tool_calls=1))
    rest = Completion([1, 2], [-0.1, -0.2], "stop", "y", loss_mask=[1, 1], tool_use=ToolUse(turns=2, tool_calls=1))
    continued = ResponseSoFar().extended(aborted, step=3).to_continue_later().extended(rest, step=4)
    new = ResponseSoFar().extended(Completion([5], [-0.5], "stop", "z", loss_mask=[1], tool_use=ToolUse(turns=1)), 4)
    samples = samples_of_group(prompts(1)[0], GroupSoFar([continued, new]), step=4)
    assert samples[0].response_token_ids == [7, 8, 9, 1, 2] and samples[0].loss_mask == [1, 0, 0, 1, 1]
    assert samples[0].response_logprobs == [-0.7, 0.0, 0.0, -0.1, -0.2] and samples[0].response_text == "xy"
    assert samples[0].response_steps == [3, 3, 3, 4, 4] and samples[1].response_steps is None
    assert multi_turn_metrics([s.tool_use for s in samples], [s.loss_mask for s in samples]) == {
        "rollout/turns_mean": 1.5, "rollout/tool_calls": 1.0, "rollout/tool_failures": 0.0,
        "rollout/tool_timeouts": 0.0, "rollout/masked_token_share": 2 / 6,
    }


def test_a_response_of_a_sample_with_its_own_prompt_ids_keeps_them_to_its_sample():
    own = ResponseSoFar().extended(Completion([5, 6], [-0.5, -0.6], "stop", "x", prompt_ids=[9, 1]), step=3)
    assert own.prompt_ids == [9, 1] and own.to_continue_later() is own  # finished: never continued
    (sample,) = samples_of_group(Prompt(1, [1], "p"), GroupSoFar([own]), step=3)
    assert (sample.prompt_ids, sample.prompt.token_ids, sample.response_token_ids) == ([9, 1], [1], [5, 6])
    row = ResponseSoFar().extended(Completion([5], [-0.5], "stop", "x"), step=3)
    assert samples_of_group(Prompt(1, [1], "p"), GroupSoFar([row]), step=3)[0].prompt_ids == [1]


def test_a_refused_request_is_a_failed_sample_that_is_not_scored():
    scored = []

    def reward(sample):
        scored.append(sample.response)
        return 1.0

    samples = generate_and_score(ScriptedGenerate({0: ["0", "refused: ValueError: too long"]}), prompts(1),
                                 SamplingConfig(n=2), RewardFn(reward, "r", False, False))
    assert scored == ["0"]
    assert [s.failure for s in samples] == [None, "ValueError: too long"]
    assert (samples[1].response_token_ids, samples[1].finish_reason, samples[1].reward) == ([], "error", 0.0)


@pytest.mark.parametrize("dynamic_sampling", [False, True])
def test_a_failed_sample_fails_its_group_which_new_prompts_replace(dynamic_sampling, capsys):
    # prompt 1 has a refused sample: the next chunk is submitted at once; once the batch is full the rest is aborted
    script = {0: ["0", "1"], 1: ["1", "refused: E1"], 2: ["2", "x"], 3: ["refused: E2", "3"], 4: ["4", "x"],
              5: ["5", "x"]}
    pool = ScriptedPool(script)
    loader = PromptLoader(prompts(7), shuffle=False)
    samples, metrics = collect(pool, loader, num_groups=3, dynamic_sampling=dynamic_sampling)
    assert all(s.failure is None for s in samples) and len(samples) == 6
    assert pool.submitted == [(0, 5), (1, 7), (2, 9), (3, 11), (4, 13), (5, 15)]
    assert [s.prompt.label for s in samples[::2]] == ["0", "2", "4"]
    assert ("rollout/dropped_groups" in metrics) == dynamic_sampling
    assert (metrics["rollout/failed_samples"], metrics["rollout/failed_groups"]) == (2, 2)
    assert (metrics["rollout/returned_prompts"], pool.aborts) == (1, 1)  # prompt 5, in flight at the end
    if dynamic_sampling:  # the failed groups are not counted as uninformative ones
        assert metrics["rollout/dropped_groups"] == 0 and metrics["rollout/informative_group_fraction"] == 1.0
    printed = capsys.readouterr().err
    assert printed.count("failed in the engine") == 1  # once for the step, not per group
    assert "2 samples in 2 groups failed in the engine (first reasons: E1 | E2); their groups were dropped" in printed


def test_a_step_whose_every_sample_fails_fails_naming_the_reason():
    pool = ScriptedPool({i: ["refused: ValueError: The input (9 tokens) is longer"] * 2 for i in range(4)})
    loader = PromptLoader(prompts(6), shuffle=False)
    with pytest.raises(AllSamplesFailed, match=r"every one of the 4 samples of this step; first: ValueError: The inp"
                                               r".*--max-prompt-length"):
        collect(pool, loader, num_groups=2)
    assert pool.aborts == 1 and not pool.in_flight  # the engines end what they still run; its prompts go back
    assert [p.row for p in loader.take(3)] == [3, 4, 5]  # 2 and 3 were in flight


def test_the_bound_on_submitted_prompts_stops_the_step_with_the_counts():
    pool = ScriptedPool({i: ["y", "y"] for i in range(8)})  # every group uninformative
    with pytest.raises(FillError, match=r"kept 0 of 2 groups after submitting 4 prompts: 3 of 3 groups had equal "
                                        r"rewards \(by shared reward: \{0.0: 3\}\).*--rollout-max-prompts"):
        collect(pool, PromptLoader(prompts(8), shuffle=False), num_groups=2, dynamic_sampling=True, max_prompts=4)
    failing = ScriptedPool({0: ["1", "1"], 1: ["refused: E1", "1"], 2: ["refused: E3", "1"], 3: ["1", "1"]})
    with pytest.raises(FillError) as info:
        collect(failing, PromptLoader(prompts(8), shuffle=False), num_groups=2, chunk_size=2, max_prompts=3)
    assert not isinstance(info.value, AllSamplesFailed)
    assert str(info.value).startswith(
        "kept 1 of 2 groups after submitting 3 prompts: 2 samples in 2 groups failed in the engine (first reasons: "
        "E1 | E3); their groups were dropped; the engine refuses a request whose prompt"
    )
    with pytest.raises(ValueError, match="more requests than a step has sampling seeds for"):
        collect(ScriptedPool({}), PromptLoader(prompts(1)), num_groups=1, max_prompts=STEP_SEED_SPAN // 2 + 1)


def test_a_prompt_stream_that_runs_out_fails_never_a_short_batch():
    pool = ScriptedPool({i: ["1", "y"] for i in range(3)})  # prompt 1 informative, 0 and 2 not
    with pytest.raises(FillError, match="prompt data ran out while filling the step's groups with 1 of 2 kept"):
        collect(pool, PromptLoader(prompts(3), shuffle=False, num_epochs=1), num_groups=2, dynamic_sampling=True)


def test_reward_failures_are_counted_and_their_reasons_printed(capsys):
    def reward(sample):
        if sample.response == "boom":
            raise ValueError("bad")
        return 1.0

    samples = generate_and_score(ScriptedGenerate({0: ["boom", "ok"]}), prompts(1), SamplingConfig(n=2),
                                 RewardFn(reward, "r", False, False))
    assert [s.reward for s in samples] == [0.0, 1.0]  # the failure score
    assert [s.reward_failed for s in samples] == [True, False]
    assert reward_and_length_metrics(samples)["rollout/reward_failures"] == 1
    printed = capsys.readouterr().err
    assert "reward function 'r' failed on 1 of 2 samples (0 by timing out; each scored 0.0)" in printed
    assert "sample 0: ValueError: bad" in printed


def test_reward_timeouts_are_failures_counted_on_their_own(capsys):
    async def reward(sample):
        if sample.response == "hang":
            await asyncio.sleep(3600)
        return 1.0

    samples = generate_and_score(ScriptedGenerate({0: ["ok", "hang"], 1: ["hang", "ok"]}), prompts(2),
                                 SamplingConfig(n=2), RewardFn(reward, "r", False, True, timeout=0.2))
    assert [s.reward for s in samples] == [1.0, 0.0, 0.0, 1.0]
    assert [s.reward_timed_out for s in samples] == [s.reward_failed for s in samples] == [False, True, True, False]
    metrics = reward_and_length_metrics(samples)
    assert metrics["rollout/reward_timeouts"] == metrics["rollout/reward_failures"] == 2
    printed = capsys.readouterr().err
    assert "failed on 2 of 4 samples (2 by timing out; each scored 0.0)" in printed
    assert "sample 1: timed out: no score within 0.2 s; sample 2: timed out" in printed


def test_a_loader_that_runs_out_is_an_error_not_a_short_batch():
    assert [p.row for p in take_prompts(PromptLoader(prompts(2), shuffle=False, num_epochs=1), 2)] == [1, 2]
    with pytest.raises(RuntimeError, match="prompt data ran out: 1 of 2 prompts left"):
        take_prompts(PromptLoader(prompts(1), num_epochs=1), 2)


TOOL_METRICS = ("rollout/turns", "rollout/tool", "rollout/masked")


class MultiTurnPool(ScriptedPool):
    """Answers every request with a multi-turn completion (an engine actor's under --tools): two sampled tokens,
    two appended, one sampled; one tool call."""

    def next_done(self):
        key, completions = super().next_done()
        return key, [
            Completion([1, 2, 3, 4, 5], [-1.0, -1.0, 0.0, 0.0, -1.0], "stop", c.text, loss_mask=[1, 1, 0, 0, 1],
                       tool_use=ToolUse(turns=2, tool_calls=1, tool_failures=int(i == 0)))
            for i, c in enumerate(completions)
        ]


def test_multi_turn_samples_carry_their_loss_mask_and_the_step_counts_their_turns_and_tool_calls():
    pool = MultiTurnPool({0: ["0", "0"], 1: ["1", "1"]})
    samples, metrics = collect(pool, PromptLoader(prompts(2), shuffle=False), num_groups=2)
    assert [s.loss_mask for s in samples] == [[1, 1, 0, 0, 1]] * 4
    assert [s.tool_use.tool_failures for s in samples] == [1, 0, 1, 0]
    tool_metrics = {key: value for key, value in metrics.items() if key.startswith(TOOL_METRICS)}
    assert tool_metrics == {
        "rollout/turns_mean": 2.0, "rollout/tool_calls": 4.0, "rollout/tool_failures": 2.0,
        "rollout/tool_timeouts": 0.0, "rollout/masked_token_share": 0.4,
    }


def test_single_turn_samples_have_no_tool_metrics():
    samples, metrics = collect(ScriptedPool({0: ["0", "0"]}), PromptLoader(prompts(1), shuffle=False), num_groups=1)
    assert samples[0].tool_use is None and not any(key.startswith(TOOL_METRICS) for key in metrics)
