"""relax.rollout.api: the step's rollout behind one interface. The default (GenerateAndScore) answers as
relax.rollout.rollout does, and the loop's collect_rollout takes any Rollout: here one that splices a tool's output
into each response, untrained, as a multi-turn rollout would."""

import json

from relax.args import AlgorithmSettings, RolloutSettings
from relax.rollout.api import Filling, GenerateAndScore, RolloutRequest, RolloutResult
from relax.rollout.data import Prompt, PromptLoader
from relax.rollout.engine import Completion, SamplingConfig
from relax.rollout.groups import Sample
from relax.rollout.rewards import load_reward_fn
from relax.rollout.rollout import generate_and_score
from relax.run.loop import collect_rollout, rollout_batch

SAMPLING = SamplingConfig(n=2, max_new_tokens=4, seed=100)


def _loader() -> PromptLoader:
    return PromptLoader([Prompt(row, [row], f"copy {row}:", label=str(row)) for row in range(4)], shuffle=False)


def _generate(prompts, sampling):
    return [[Completion([prompt.token_ids[0], 9], [-0.5, -1.0], "stop", str(prompt.token_ids[0]))
             for _ in range(sampling.n)] for prompt in prompts]


class InOrderPool:
    """An engine pool (relax.rollout.rollout.EnginePool) whose groups complete in submission order, answered by
    `generate` one group a call (request j of a group seeded as the group's sampling says)."""

    weights_ahead = 0

    def __init__(self, generate):
        self.generate, self.in_flight = generate, {}

    def submit(self, key, prompt, sampling, prefixes=None, source=None):
        assert prefixes is None, "nothing is continued without --partial-rollout"
        assert source.token_ids == prompt
        self.in_flight[key] = (source, sampling)

    def next_done(self):
        key = min(self.in_flight)
        prompt, sampling = self.in_flight.pop(key)
        return key, self.generate([prompt], sampling)[0]

    def abort(self):
        raise AssertionError("nothing is in flight once the batch is full without over-sampling")


def test_the_default_rollout_takes_the_steps_prompts_and_answers_as_generate_and_score():
    reward = load_reward_fn("exact_match")
    filling = Filling(over_sampling_batch_size=2, dynamic_sampling=False, max_prompts=20)
    result = GenerateAndScore(InOrderPool(_generate), reward, filling)(RolloutRequest(0, _loader(), 2, SAMPLING))
    expected = generate_and_score(_generate, _loader().take(2), SAMPLING, reward)
    assert result == RolloutResult(expected, {
        "rollout/failed_samples": 0, "rollout/failed_groups": 0, "rollout/submitted_groups": 2,
        "rollout/aborted_groups": 0, "rollout/returned_prompts": 0, "rollout/informative_group_fraction": 0.0,
    })
    assert [s.loss_mask for s in result.samples] == [[1, 1]] * 4


class ToolRollout:
    """A multi-turn rollout: the policy's turn, a tool's output (2 tokens, not the policy's), the policy's answer."""

    def __init__(self):
        self.requests = []

    def __call__(self, request: RolloutRequest) -> RolloutResult:
        self.requests.append(request)
        samples = [
            Sample(prompt, [5, 70, 71, 6], [-0.1, 0.0, 0.0, -0.2], "stop", "answer", reward=float(i % 2),
                   loss_mask=[1, 0, 0, 1])
            for prompt in request.prompts.take(request.num_groups) for i in range(request.sampling.n)
        ]
        return RolloutResult(samples, {"rollout/tool_calls": float(len(samples))})


def test_the_loop_trains_on_any_rollout_and_saves_its_loss_masks(tmp_path):
    rollout = RolloutSettings(
        data=None, shuffle=False, reward_fn=None, reward_timeout=None, sampling=SAMPLING, batch_size=2,
        devices_per_engine=1, dynamic_sampling=False, over_sampling_batch_size=None, max_prompts=None, partial=None,
        overlong_buffer_len=None, overlong_penalty_factor=1.0, load_data=None,
        save_data=str(tmp_path / "step_{step}.jsonl"), routing_replay=False, context=None,
    )
    tool_rollout, loader = ToolRollout(), _loader()
    samples, metrics = collect_rollout(3, tool_rollout, loader, SAMPLING, rollout)
    assert tool_rollout.requests == [RolloutRequest(3, loader, 2, SAMPLING)]
    assert metrics["rollout/tool_calls"] == 4.0 and metrics["rollout/reward_mean"] == 0.5
    saved = [json.loads(line) for line in (tmp_path / "step_3.jsonl").read_text().splitlines()[1:]]
    assert [s["loss_mask"] for group in saved for s in group["samples"]] == [[1, 0, 0, 1]] * 4

    algorithm = AlgorithmSettings(
        advantage_estimator="grpo", normalize_advantages_by_std=True, group_size=2, global_batch_size=4,
        uses_reference=False,
    )
    batch = rollout_batch(samples, algorithm)
    assert all(mask.tolist() == [1.0, 0.0, 0.0, 1.0] for mask in batch.loss_mask)
    assert all(a[1:3].tolist() == [0.0, 0.0] and a[0] != 0.0 for a in batch.advantages)  # the tool's tokens
