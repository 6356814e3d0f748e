"""A custom generate function (--custom-generate-function-path) through the real loop on CPU (scripts/run-tiny-cpu.sh):
tests/e2e/two_turn_generate.py's two turns around a masked "tool" text run in the engine actor, the saved samples
carry the mask and the engine's logprobs (0.0 where masked), the step trains on them, and the step's failed and
ABORTED samples are counted; the evaluations sample through the function too (one turn each). Half of the trained
samples are those of a function written for slime (tests/e2e/slime_style_generate.py), which posts its turns to the
engine actor's /generate endpoint at args.sglang_router_ip:port: they are trained as the engine returned them. One
in four is an agent's written with the openai client (tests/e2e/chat_agent_generate.py), two chat completions of an
agent session with a tool message between them, its own system prompt first: trained as its first call's rendering
(the sample's own prompt ids, saved with it), then the ids the engine sampled around the chat template's tool turn,
which is masked. The prompts are rendered with the chat template (--apply-chat-template), as the agent's
conversation is. The last call of each trained group fans out: it returns its sample and that sample's first turn
alone (chat_agent_generate.first_turn_of), which joins the group: the step trains groups of N + 1 samples, each
sample's advantage its reward minus the mean of its whole group's. The run over-samples with --partial-rollout: the
samples the function returns ABORTED with their first turn (its own ABORTED, and those the step's abort ends once the
batch is full) go back with their prompts, and the next step calls the function with each exactly as it was returned
(two_turn_generate's records); the continued samples' training and ages: tests/unit/test_custom_generate.py."""

import json
import os
from types import SimpleNamespace

import pytest

import transformers

from chat_agent_generate import AGENT_SAMPLE, TOOLS, first_messages
from relax.args.settings import AlgorithmSettings
from relax.rollout.dump import load_rollout_data, rollout_data_path
from relax.rollout.turns import ChatTurns
from relax.run.loop import rollout_batch
from tiny_runs import ROOT, run_tiny_job, step_records
from two_turn_generate import FIRST_TURN_TOKENS, TOOL_TEXT, group_of, tool_ids

N = 4  # samples per prompt
FANNED_OUT = N  # the index in a trained group of its last call's second sample (first_turn_of)
# The tiny run's estimator: each sample's advantage is its reward minus its group's mean (scripts/run-tiny-cpu.sh)
DR_GRPO = AlgorithmSettings(advantage_estimator="grpo", normalize_advantages_by_std=False, group_size=N,
                            global_batch_size=8, uses_reference=False)
# The response's budget: room for the agent's first turn, the chat template's tool turn (about 25 tokens) and more
BUDGET = 32


def test_a_run_trains_on_the_functions_two_turn_samples_with_the_tool_text_masked(tmp_path):
    pattern = str(tmp_path / "rollouts" / "step_{step}.jsonl")
    python_path = os.pathsep.join(filter(None, [str(ROOT / "tests" / "e2e"), os.environ.get("PYTHONPATH")]))
    over_http = tmp_path / "http_samples.jsonl"  # what the engine returned to slime_style_generate's requests
    by_agent = tmp_path / "agent_samples.jsonl"  # what the chat completions answered chat_agent_generate's agent
    partial = tmp_path / "partial_samples.jsonl"  # the samples two_turn_generate returned ABORTED, and was given back
    all_records = run_tiny_job(
        tmp_path, "--num-steps", "2", "--custom-generate-function-path", "chat_agent_generate.with_an_agent",
        "--apply-chat-template", "--rollout-batch-size", "2", "--n-samples-per-prompt", str(N),
        "--global-batch-size", "8", "--micro-batch-size", "8", "--rollout-max-response-len", str(BUDGET),
        "--eval-max-response-len", "2", "--save-rollout-data", pattern,
        "--over-sampling-batch-size", "5", "--partial-rollout",
        env={"PYTHONPATH": python_path, "RELAX_TEST_HTTP_SAMPLES": str(over_http),
             "RELAX_TEST_AGENT_SAMPLES": str(by_agent), "RELAX_TEST_PARTIAL_SAMPLES": str(partial)},
    )
    records = step_records(all_records)
    assert len(records) == 2
    evaluations = [r for r in all_records if "eval/held_out/reward_mean" in r]
    assert [r["step"] for r in evaluations] == [0, 2]
    assert all(r["eval/held_out/failed_samples"] == 0 for r in evaluations), evaluations
    for record in records:
        assert record["train/update_successful"] == 1.0
        # each step: the first group failed (generated anew from another prompt), the second came back ABORTED
        assert record["rollout/failed_samples"] == N and record["rollout/failed_groups"] == 1, record
        assert record["rollout/function_aborted_samples"] == N, record
        assert record["rollout/fan_out_samples"] == 2, record  # one per trained group
        # 5 groups at once; the second and the surplus one go back with their first turns, continued next step
        assert record["rollout/submitted_groups"] == 5 and record["rollout/returned_prompts"] == 2, record
        assert record["rollout/partial_carried_tokens"] > 0 and record["rollout/partial_restarted_calls"] == 0, record
    check_continued_samples(partial, N, records[0]["rollout/partial_carried_tokens"])

    tool = tool_ids(str(tmp_path / "model"))
    turns = ChatTurns(transformers.AutoTokenizer.from_pretrained(tmp_path / "model"))
    returned = [json.loads(line) for line in over_http.read_text().splitlines()]
    agent_sessions = [json.loads(line) for line in by_agent.read_text().splitlines()]
    for step in range(2):
        header, *groups = [json.loads(line) for line in rollout_data_path(pattern, step).read_text().splitlines()]
        samples = [sample for group in groups for sample in group["samples"]]
        assert len(samples) == 2 * (N + 1) and header["group_sizes"] == [N + 1, N + 1]
        check_trained_advantages(pattern, step)
        for group in groups:  # its odd samples posted to /generate: trained as the engine returned them
            for j in range(1, N, 2):
                trained = group["samples"][j]
                answers = [r for r in returned if r["prompt_ids"] == group["prompt"]["token_ids"]
                           and r["sampling_seed"] % N == j and r["response_token_ids"] == trained["response_token_ids"]]
                assert answers, (step, j, trained)
                assert trained["loss_mask"] == answers[0]["loss_mask"]
                assert trained["response_logprobs"] == pytest.approx(answers[0]["response_logprobs"], abs=1e-6)
            check_agent_sample(turns, group, group["samples"][AGENT_SAMPLE], agent_sessions)
            check_first_turn_sibling(group["samples"][FANNED_OUT - 1], group["samples"][FANNED_OUT])
        for sample in (sample for group in groups for j, sample in enumerate(group["samples"])
                       if j not in (AGENT_SAMPLE, FANNED_OUT)):
            assert sample["prompt_token_ids"] is None  # the data row's prompt ids
            ids, mask, logprobs = sample["response_token_ids"], sample["loss_mask"], sample["response_logprobs"]
            first = mask.index(0)  # the first turn's tokens, then the tool text, then the second turn's
            assert 1 <= first <= FIRST_TURN_TOKENS and len(ids) <= BUDGET
            assert ids[first:first + len(tool)] == tool
            assert mask == [1] * first + [0] * len(tool) + [1] * (len(ids) - first - len(tool))
            assert logprobs[first:first + len(tool)] == [0.0] * len(tool)
            assert all(value < 0.0 for value, trained in zip(logprobs, mask) if trained)


def check_continued_samples(path, n: int, carried_by_the_first_step: int) -> None:
    """Each sample a call was given to continue is one that an earlier call returned ABORTED, field for field
    (its prompt ids and first turn, text, mask, logprobs and metadata), with status ABORTED and the whole response's
    budget; the first step's second group's samples all were (its prompt is the next step's first), and the first
    step carried the tokens of the samples it returned."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    fields = ("tokens", "response", "response_length", "loss_mask", "rollout_log_probs", "metadata")
    returned = {r["metadata"]["returned_by_seed"]: r for r in records if r["kind"] == "returned"}
    continued = [r for r in records if r["kind"] == "continued"]
    for given in continued:
        earlier = returned[given["metadata"]["returned_by_seed"]]
        assert {name: given[name] for name in fields} == {name: earlier[name] for name in fields}, (given, earlier)
        assert given["status"] == "ABORTED" and given["max_new_tokens"] == BUDGET
        assert 1 <= given["response_length"] and given["loss_mask"] == [1] * given["response_length"]
    first_step_seed = records[0]["sampling_seed"] >> 24  # the first step's seeds: step seed (a multiple of 2**24) + ...
    first_step = [r for r in returned.values() if r["sampling_seed"] >> 24 == first_step_seed]
    assert sorted(group_of_record(r, n) for r in first_step)[:n] == [1] * n  # its second group's, then its surplus'
    assert {group_of_record(r, n) for r in first_step} == {1, 4}
    continued_seeds = {given["metadata"]["returned_by_seed"] for given in continued}
    assert {r["sampling_seed"] for r in first_step if group_of_record(r, n) == 1} <= continued_seeds
    assert carried_by_the_first_step == sum(r["response_length"] for r in first_step)


def group_of_record(record: dict, n: int) -> int:
    return group_of(SimpleNamespace(n_samples_per_prompt=n), record)


def check_first_turn_sibling(sample: dict, sibling: dict) -> None:
    """The fanned-out sibling is the sample's first turn alone: its ids up to the first masked one, all trained,
    with their logprobs."""
    turn = sample["loss_mask"].index(0)
    assert sibling["response_token_ids"] == sample["response_token_ids"][:turn]
    assert sibling["loss_mask"] == [1] * turn and sibling["prompt_token_ids"] is None
    assert sibling["response_logprobs"] == sample["response_logprobs"][:turn]


def check_trained_advantages(pattern: str, step: int) -> None:
    """The step's batch as the loop trains it (rollout_batch of its saved samples): every sample's advantage is its
    reward minus the mean of its group's N + 1 rewards, the fanned-out sibling's included."""
    samples = load_rollout_data(pattern, step, num_groups=2, samples_per_prompt=N)
    batch = rollout_batch(samples, DR_GRPO)
    for start in (0, N + 1):
        rewards = [sample.reward for sample in samples[start:start + N + 1]]
        for sample, reward, advantages in zip(samples[start:], rewards, batch.advantages[start:start + N + 1]):
            expected = [reward - sum(rewards) / (N + 1) if trained else 0.0 for trained in sample.loss_mask]
            assert advantages.tolist() == pytest.approx(expected, abs=1e-6), (step, rewards)


def check_agent_sample(turns: ChatTurns, group: dict, trained: dict, agent_sessions: list[dict]) -> None:
    """The agent's sample is its first call's rendering (its own system prompt, the row's question, its tools: the
    sample's prompt ids), the ids its first call sampled, the chat template's tool turn after them (mask 0, logprob
    0.0) and the ids its second call sampled, as the chat completions answered them."""
    prompt, ids, mask = trained["prompt_token_ids"], trained["response_token_ids"], trained["loss_mask"]
    assert prompt == turns.prompt_ids(first_messages(group["prompt"]["label"]), TOOLS) != group["prompt"]["token_ids"]
    (session,) = [r for r in agent_sessions if r["prompt_ids"] == prompt and r["sampling_seed"] % N == AGENT_SAMPLE
                  and r["response_token_ids"] == ids]
    first, second = session["calls"]
    sampled = ids[:first["completion_tokens"]]
    assert 1 <= len(sampled) <= FIRST_TURN_TOKENS and first["prompt_tokens"] == len(prompt)
    assert turns.tokenizer.decode(sampled[:len(sampled) - turns.sampled_end_of_turn(sampled)]) == first["content"]
    appended = turns.after_assistant_messages(sampled, [{"role": "tool", "content": TOOL_TEXT}])
    assert ids[len(sampled):len(sampled) + len(appended)] == appended
    assert second["prompt_tokens"] == len(prompt) + len(sampled) + len(appended)  # the engine's second request
    assert len(ids) == len(sampled) + len(appended) + second["completion_tokens"] <= BUDGET
    assert mask == [1] * len(sampled) + [0] * len(appended) + [1] * second["completion_tokens"]
    logprobs = trained["response_logprobs"]
    assert logprobs[len(sampled):len(sampled) + len(appended)] == [0.0] * len(appended)
    assert all(value < 0.0 for value, trained_token in zip(logprobs, mask) if trained_token)
