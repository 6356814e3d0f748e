"""Rollout data files (--save-rollout-data / --load-rollout-data): the format, exact round trips, and
errors that name the file and the step."""

import argparse
import json
from functools import partial

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from relax.args import RolloutSettings
from relax.args.checks import Parsed, rollout_data_patterns_valid
from relax.run.loop import collect_rollout, rollout_of
from relax.rollout.data import Prompt
from relax.rollout.engine import SamplingConfig
from relax.rollout.dump import (
    FORMAT,
    VERSION,
    RolloutDataError,
    check_rollout_data,
    experts_path_of,
    load_rollout_data,
    pattern_problem,
    rollout_data_path,
    save_rollout_data,
)
from relax.rollout.groups import Sample, group_by_prompt


def _samples():
    a = Prompt(row=3, token_ids=[1, 2], text="écris 7", label={"answer": [7, "7"]}, metadata={"source": "t", "k": 1})
    b = Prompt(row=9, token_ids=[4], text="b", label=None)
    return [
        # floats that only survive a round trip written as repr
        Sample(a, [5, 6], [0.1 + 0.2, -1e-300], "stop", "7\n", reward=1 / 3, reward_failed=False),
        Sample(a, [8], [float("-inf")], "length", "x", reward=0.0, reward_failed=True),
        Sample(b, [9, 9, 9], [-0.5, -0.25, -2.0], "abort", "", reward=-1.5, loss_mask=[1, 0, 1]),  # a tool's token
        Sample(b, [7], [-3.0], "stop", "y", reward=2.0, own_prompt_ids=[11, 12, 4]),  # an agent's own prompt
    ]


def test_round_trip_is_exact_and_groups_share_their_prompt(tmp_path):
    samples = _samples()
    path = save_rollout_data(str(tmp_path / "d" / "step_{step}.jsonl"), 4, samples, samples_per_prompt=2)
    assert path == tmp_path / "d" / "step_4.jsonl"
    assert not list(path.parent.glob("*.partial"))

    loaded = load_rollout_data(str(tmp_path / "d" / "step_{step}.jsonl"), 4, num_groups=2, samples_per_prompt=2)
    assert loaded == samples
    assert [s.response_logprobs for s in loaded] == [s.response_logprobs for s in samples]  # -inf, 0.30000000000000004
    assert loaded[0].reward == 1 / 3 and loaded[0].response_logprobs[0] == 0.1 + 0.2
    assert loaded[0].prompt is loaded[1].prompt  # one Prompt per group, as the generator makes them
    assert [g.prompt.row for g in group_by_prompt(loaded, 2)] == [3, 9]


def test_the_documented_format(tmp_path):
    path = save_rollout_data(str(tmp_path / "s{step:03d}.jsonl"), 12, _samples(), samples_per_prompt=2)
    assert path.name == "s012.jsonl"
    header, *groups = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert header == {
        "format": FORMAT, "version": VERSION, "step": 12, "num_groups": 2, "samples_per_prompt": 2,
        "routed_experts": None,
    }
    assert groups[0]["prompt"] == {
        "row": 3, "token_ids": [1, 2], "text": "écris 7", "label": {"answer": [7, "7"]}, "metadata": {"source": "t", "k": 1}
    }
    assert groups[1]["samples"][1]["prompt_token_ids"] == [11, 12, 4]
    assert groups[1]["samples"][0] == {
        "prompt_token_ids": None, "response_token_ids": [9, 9, 9], "response_logprobs": [-0.5, -0.25, -2.0],
        "loss_mask": [1, 0, 1],
        "finish_reason": "abort", "response_text": "", "reward": -1.5, "reward_failed": False,
    }


def test_path_patterns(tmp_path):
    assert rollout_data_path("a/{step}/b.jsonl", 7).as_posix() == "a/7/b.jsonl"
    with pytest.raises(RolloutDataError, match=r"only the field \{step\}"):
        rollout_data_path("a/{epoch}.jsonl", 0)
    assert pattern_problem("--save-rollout-data", "d/{step}.jsonl", 10) is None
    assert pattern_problem("--save-rollout-data", "d/one.jsonl", 1) is None
    assert "every step of the 10 would overwrite" in pattern_problem("--save-rollout-data", "d/one.jsonl", 10)
    assert pattern_problem("--load-rollout-data", "d/one.jsonl", 10) is None  # one rollout, replayed every step
    assert pattern_problem("--load-rollout-data", "d/{bad", 1).startswith("--load-rollout-data rollout data path")

    def problem(**flags):
        r = argparse.Namespace(**{"save_rollout_data": None, "load_rollout_data": None, "num_steps": 5, **flags})
        return rollout_data_patterns_valid(Parsed(flags=r, megatron=None, sglang=None), platform=None)

    assert problem() is None and problem(save_rollout_data="x_{step}") is None
    assert problem(save_rollout_data="x").startswith("--save-rollout-data 'x' has no {step}")


def _write(path, header_changes=None, groups=None):
    header = {"format": FORMAT, "version": VERSION, "step": 0, "num_groups": 1, "samples_per_prompt": 1}
    group = {
        "prompt": {"row": 1, "token_ids": [1], "text": "p", "label": None, "metadata": {}},
        "samples": [
            {"response_token_ids": [2], "response_logprobs": [-1.0], "finish_reason": "stop",
             "response_text": "r", "reward": 1.0, "reward_failed": False}
        ],
    }
    lines = [json.dumps({**header, **(header_changes or {})})] + [json.dumps(g) for g in (groups or [group])]
    path.write_text("\n".join(lines) + "\n")
    return group


@pytest.mark.parametrize(
    "make, error",
    [
        (lambda p: None, r"step 2: .*bad_2\.jsonl does not exist \(write it with --save-rollout-data"),
        (lambda p: p.write_text(""), "is empty"),
        (lambda p: p.write_text('{"format": "relax.rollout_data", "version": 1\n'), "line 1: invalid JSON"),
        (lambda p: p.write_text('{"something": "else"}\n'), "line 1: not a relax.rollout_data header"),
        (lambda p: _write(p, {"version": 99}), "format version 99; this relax reads versions 1, 2"),
        (lambda p: _write(p, {"num_groups": 3}), "the header says 3 groups, the file holds 1"),
        (lambda p: _write(p, {"samples_per_prompt": 4}), "holds 1 groups of 4 samples; this run trains on"),
    ],
    ids=["missing", "empty", "invalid-json", "not-a-header", "version", "count", "shape"],
)
def test_bad_files_fail_naming_the_path_and_step(tmp_path, make, error):
    make(tmp_path / "bad_2.jsonl")
    with pytest.raises(RolloutDataError, match=error) as info:
        load_rollout_data(str(tmp_path / "bad_{step}.jsonl"), 2, num_groups=1, samples_per_prompt=1)
    assert f"--load-rollout-data, step 2: {tmp_path / 'bad_2.jsonl'}" in str(info.value)


@pytest.mark.parametrize(
    "corrupt, error",
    [
        (lambda g: g["samples"][0].pop("reward"), "KeyError: 'reward'"),
        (lambda g: g["samples"][0].update(response_logprobs=[]), "1 response tokens and 0 logprobs"),
        (lambda g: g["samples"][0].update(response_token_ids=["2"]), "response_token_ids must be a list of integers"),
        (lambda g: g["samples"][0].update(reward="1"), "reward is str"),
        (lambda g: g["prompt"].update(metadata=[]), "metadata is list, expected dict"),
        (lambda g: g["samples"].append(dict(g["samples"][0])), "2 samples, the header says 1"),
        (lambda g: g["samples"][0].update(loss_mask=[1, 1]), "a loss_mask of 2 values: it must hold a 0 or 1 for each"),
        (lambda g: g["samples"][0].update(prompt_token_ids=[]), "a sample's own prompt ids are empty"),
        (lambda g: g["samples"][0].update(prompt_token_ids=[1.5]), "prompt_token_ids must be a list of integers"),
    ],
    ids=["missing-key", "logprob-count", "token-type", "reward-type", "metadata-type", "group-size", "loss-mask",
         "empty-prompt", "prompt-type"],
)
def test_malformed_groups_name_their_line(tmp_path, corrupt, error):
    path = tmp_path / "d.jsonl"
    group = _write(path)
    corrupt(group)
    _write(path, groups=[group])
    with pytest.raises(RolloutDataError, match=rf"step 0: .*d\.jsonl line 2: malformed group \(.*{error}"):
        load_rollout_data(str(path), 0, num_groups=1, samples_per_prompt=1)


def _with_experts(samples, highest_id):
    """Each sample with int16 routed experts (as the engine returns them) for every token but the last, 2 layers by
    top-2, ids up to `highest_id`."""
    for i, s in enumerate(samples):
        rows = len(s.prompt_ids) + len(s.response_token_ids) - 1
        s.routed_experts = (torch.arange(rows * 4).reshape(rows, 2, 2) * 37 + i) % (highest_id + 1)
        s.routed_experts = s.routed_experts.to(torch.int16)
        s.routed_experts[-1, -1, -1] = highest_id
    return samples


@pytest.mark.parametrize("highest_id, stored", [(255, torch.uint8), (300, torch.int16)])
def test_routed_experts_round_trip_bit_exact_beside_the_file_in_the_smallest_dtype(tmp_path, highest_id, stored):
    samples = _with_experts(_samples(), highest_id)
    path = save_rollout_data(str(tmp_path / "step_{step}.jsonl"), 5, samples, samples_per_prompt=2)
    experts_path = experts_path_of(path)
    assert experts_path.name == "step_5.jsonl.experts.safetensors"
    assert json.loads(path.read_text().splitlines()[0])["routed_experts"] == experts_path.name
    assert not list(tmp_path.glob("*.partial"))
    with safe_open(str(experts_path), framework="pt") as f:
        assert sorted(f.keys(), key=int) == ["0", "1", "2", "3"]
        assert {f.get_tensor(name).dtype for name in f.keys()} == {stored}

    loaded = load_rollout_data(str(tmp_path / "step_{step}.jsonl"), 5, 2, 2, with_routed_experts=True)
    for saved, back in zip(samples, loaded):
        assert back.routed_experts.dtype == torch.int16 and torch.equal(back.routed_experts, saved.routed_experts)
    # A run that does not replay them reads only the JSON lines.
    assert all(s.routed_experts is None for s in load_rollout_data(str(path), 5, 2, 2))


def test_version_1_files_load_without_experts_and_a_replaying_run_is_told_how_to_get_them(tmp_path):
    path = tmp_path / "v1.jsonl"
    group = _write(path, {"version": 1})  # a version 1 header: no "routed_experts"
    (sample,) = load_rollout_data(str(path), 0, num_groups=1, samples_per_prompt=1)
    assert (sample.response_token_ids, sample.reward, sample.routed_experts) == ([2], 1.0, None)
    assert sample.prompt.token_ids == group["prompt"]["token_ids"]
    with pytest.raises(RolloutDataError, match=(
        rf"step 0: {path} holds no routed experts \(saved by a run without --use-rollout-routing-replay, or in "
        r"format version 1\), .*: save the rollouts again with --use-rollout-routing-replay, or drop it"
    )):
        load_rollout_data(str(path), 0, num_groups=1, samples_per_prompt=1, with_routed_experts=True)


def test_missing_or_mismatched_experts_fail_naming_both_files(tmp_path):
    pattern = str(tmp_path / "s{step}.jsonl")
    path = save_rollout_data(pattern, 0, _samples(), samples_per_prompt=2)  # no experts
    with pytest.raises(RolloutDataError, match=r"s0\.jsonl holds no routed experts \(saved by a run without"):
        load_rollout_data(pattern, 0, 2, 2, with_routed_experts=True)

    path = save_rollout_data(pattern, 0, _with_experts(_samples(), 7), samples_per_prompt=2)
    experts_path = experts_path_of(path)
    experts_path.unlink()
    with pytest.raises(RolloutDataError, match=(
        rf"step 0: {path}: its routed experts {experts_path} do not exist \(the header names them\): keep them"
    )):
        load_rollout_data(pattern, 0, 2, 2, with_routed_experts=True)

    # Experts of another rollout: the batch's own check names the sample whose token count they miss.
    wrong = {str(i): torch.zeros(2, 2, 2, dtype=torch.uint8) for i in range(4)}
    save_file(wrong, str(experts_path))
    with pytest.raises(RolloutDataError, match=(
        rf"{experts_path} do not match its samples \(routed_experts\[0\] has shape \(2, 2, 2\), expected \(3, "
    )):
        load_rollout_data(pattern, 0, 2, 2, with_routed_experts=True)


def test_labels_that_are_not_json_fail_and_leave_no_file(tmp_path):
    samples = _samples()
    samples[2].prompt.label = {1, 2}
    with pytest.raises(RolloutDataError, match=r"step 0: cannot write .*: the label or metadata of prompt row 9"):
        save_rollout_data(str(tmp_path / "{step}.jsonl"), 0, samples, samples_per_prompt=2)
    assert not list(tmp_path.iterdir())


def _loop_settings(**changes) -> RolloutSettings:
    base = dict(
        data=None, shuffle=False, reward_fn=None, reward_timeout=None,
        sampling=SamplingConfig(n=2, max_new_tokens=3), batch_size=2,
        devices_per_engine=1, dynamic_sampling=False, over_sampling_batch_size=None, max_prompts=None, partial=None,
        overlong_buffer_len=None, overlong_penalty_factor=1.0, load_data=None, save_data=None, routing_replay=False,
        context=None,
    )
    return RolloutSettings(**{**base, **changes})


def test_the_loop_replays_a_saved_step_and_penalises_overlong_responses_after_loading(tmp_path):
    save_rollout_data(str(tmp_path / "in_{step}.jsonl"), 1, _samples(), samples_per_prompt=2)
    rollout = _loop_settings(
        load_data=str(tmp_path / "in_{step}.jsonl"), save_data=str(tmp_path / "out_{step}.jsonl"),
        overlong_buffer_len=1,
    )
    replay = rollout_of(rollout, engines=None, reward_fn=None)
    samples, metrics = collect_rollout(1, replay, loader=None, sampling=rollout.sampling, rollout=rollout)
    # Saved again unchanged: the file holds the reward function's scores, the penalty comes after.
    assert (tmp_path / "out_1.jsonl").read_text() == (tmp_path / "in_1.jsonl").read_text()
    assert metrics["rollout/reward_mean"] == pytest.approx((1 / 3 + 0.0 - 1.5 + 2.0) / 4)
    assert metrics["rollout/reward_failures"] == 1.0
    # 3 tokens of at most 3 with a 1-token buffer: -1; shorter responses keep their reward
    assert [s.reward for s in samples] == [1 / 3, 0.0, -2.5, 2.0]
    # Each replayed sample trains on the sequence it was saved with: its own prompt ids where it had them
    assert [s.prompt_ids + s.response_token_ids for s in samples] == [[1, 2, 5, 6], [1, 2, 8], [4, 9, 9, 9],
                                                                      [11, 12, 4, 7]]
    with pytest.raises(RolloutDataError, match=r"step 2: .*in_2\.jsonl does not exist"):
        collect_rollout(2, replay, loader=None, sampling=rollout.sampling, rollout=rollout)


def test_the_loop_replays_and_saves_again_the_routed_experts_under_routing_replay(tmp_path):
    samples = _with_experts(_samples(), 9)
    save_rollout_data(str(tmp_path / "in_{step}.jsonl"), 0, samples, samples_per_prompt=2)
    rollout = _loop_settings(
        load_data=str(tmp_path / "in_{step}.jsonl"), save_data=str(tmp_path / "out_{step}.jsonl"), routing_replay=True
    )
    replay = rollout_of(rollout, engines=None, reward_fn=None)
    replayed, _ = collect_rollout(0, replay, loader=None, sampling=rollout.sampling, rollout=rollout)
    assert all(torch.equal(a.routed_experts, b.routed_experts) for a, b in zip(replayed, samples))
    saved_again = (tmp_path / "out_0.jsonl.experts.safetensors").read_bytes()
    assert saved_again == (tmp_path / "in_0.jsonl.experts.safetensors").read_bytes()


def test_the_check_before_a_run_reads_headers_and_the_dry_runs_check_reads_all(tmp_path):
    pattern = str(tmp_path / "s{step}.jsonl")
    for step in (1, 2):
        save_rollout_data(pattern, step, _with_experts(_samples(), 7), samples_per_prompt=2)
    check = partial(check_rollout_data, pattern, range(1, 3), 2, 2, True)
    assert check(read_samples=False) == (
        f"{pattern}: 2 files found, their headers checked (each is read whole at its step), steps 1-2, 2 groups x 2 "
        "samples, with routed experts"
    )
    assert check(read_samples=True) == f"{pattern}: 2 files read, steps 1-2, 2 groups x 2 samples, with routed experts"
    # A bad group line is found only by reading the whole file; missing experts by either.
    path = tmp_path / "s2.jsonl"
    header, group, *rest = path.read_text().splitlines()
    path.write_text("\n".join([header, group.replace('"reward": ', '"reward": "'), *rest]) + "\n")
    check(read_samples=False)
    with pytest.raises(RolloutDataError, match=r"step 2: .*s2\.jsonl line 2: invalid JSON"):
        check(read_samples=True)
    experts_path_of(tmp_path / "s1.jsonl").unlink()
    for read_samples in (False, True):
        with pytest.raises(RolloutDataError, match=r"step 1: .*s1\.jsonl: its routed experts .* do not exist"):
            check(read_samples=read_samples)


@pytest.mark.parametrize("version", [1, 2])
def test_files_before_loss_masks_load_with_every_response_token_trained(tmp_path, version):
    path = tmp_path / "old.jsonl"
    group = _write(path, {"version": version})
    assert "loss_mask" not in group["samples"][0]  # as those versions wrote them
    (sample,) = load_rollout_data(str(path), 0, num_groups=1, samples_per_prompt=1)
    assert sample.loss_mask == [1]


@pytest.mark.parametrize("version", [1, 2, 3])
def test_files_before_samples_own_prompts_load_each_sample_after_its_rows_prompt(tmp_path, version):
    path = tmp_path / "old.jsonl"
    group = _write(path, {"version": version})
    assert "prompt_token_ids" not in group["samples"][0]  # as those versions wrote them
    (sample,) = load_rollout_data(str(path), 0, num_groups=1, samples_per_prompt=1)
    assert sample.own_prompt_ids is None and sample.prompt_ids == group["prompt"]["token_ids"] == [1]
