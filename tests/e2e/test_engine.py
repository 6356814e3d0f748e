"""relax.rollout.engine on SGLang's real in-process Engine (CPU, float32, tiny random Qwen3), checked
against HF transformers, and a rollout through it. One engine serves the module and is checked to stop
cleanly at its end; one more is started to test death.
"""

import os
import signal
import threading
import time

import psutil
import pytest
import torch
import transformers
from safetensors.torch import load_file

from relax.platform import get_platform
from relax.rollout.data import PromptDataConfig, PromptLoader, load_prompts
from relax.rollout.engine import EngineDeadError, RolloutEngine, SamplingConfig, WeightUpdateError, engine_files
from relax.rollout.groups import group_by_prompt
from relax.rollout.rewards import RewardInput, load_reward_fn
from relax.rollout.rollout import generate_and_score, reward_and_length_metrics, take_prompts
from relax.rollout.synthetic import copy_digit_reward, write_task
from relax.sync.bucket import bucket_specs, serialize_bucket, split_into_buckets
from relax.tools.tiny_model import build_tiny_model

# A small KV pool: the platform's memory fraction would reserve ~1 GB for a model of 80k parameters.
SERVER_ARGS = {"max_total_tokens": 4096}
PROMPTS = [[5, 6], [1, 33, 31, 17, 30, 54, 15, 27, 28], [(7 * i) % 50 + 3 for i in range(40)]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_models")
    return build_tiny_model(root / "initial", "qwen3", seed=0), build_tiny_model(root / "updated", "qwen3", seed=1)


@pytest.fixture(scope="module")
def engine(models):
    with RolloutEngine(SERVER_ARGS, model_path=str(models[0]), platform=get_platform("cpu")) as engine:
        pids, files = engine.child_pids, engine_files(engine._engine)
        assert any(path.exists() for path in files)
        yield engine
    # Leaving the with-block stopped it: its processes killed and reaped (no zombies), its files removed.
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert not any(path.exists() for path in files)


def hf_greedy(model, prompt, steps):
    """Greedy tokens from HF transformers and the log-probability of each under the model."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    generated = ids[len(prompt):]
    return generated, [float(logprobs[len(prompt) - 1 + i, token]) for i, token in enumerate(generated)]


def assert_engine_matches_hf(engine, model_dir, steps=8):
    greedy = SamplingConfig(n=2, temperature=0.0, max_new_tokens=steps, ignore_eos=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, completions in zip(PROMPTS, engine.generate(PROMPTS, greedy)):
        tokens, logprobs = hf_greedy(model, prompt, steps)
        for completion in completions:
            assert completion.token_ids == tokens
            assert completion.finish_reason == "length"
            assert max(abs(a - b) for a, b in zip(completion.logprobs, logprobs)) < 1e-4


def test_the_admission_budget_is_the_schedulers_own(engine):
    """Read from the running scheduler: the KV pool SERVER_ARGS asked for, SGLang's default conservativeness and
    reservation settings, and the scheduler's cap on running requests."""
    budget = engine.admission_budget()
    assert budget.kv_cache_tokens == SERVER_ARGS["max_total_tokens"]
    assert (budget.conservativeness, budget.init_ratio, budget.reserve_clip) == (1.0, 0.7, 4096)
    assert budget.max_running_requests > 0


def test_greedy_tokens_and_logprobs_match_hf(engine, models):
    assert_engine_matches_hf(engine, models[0])


def test_sampling_settings_reach_the_engine(engine, models):
    reference = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True))[0][0]
    # top_k=1 (and a tiny top_p) leave only the argmax even at temperature 1
    for sampling in (SamplingConfig(n=3, top_k=1, max_new_tokens=6, ignore_eos=True),
                     SamplingConfig(n=3, top_p=1e-6, max_new_tokens=6, ignore_eos=True)):
        assert [c.token_ids for c in engine.generate(PROMPTS[:1], sampling)[0]] == [reference.token_ids] * 3
    # a stop token ends the response with it (and reports "stop"); max_new_tokens ends with "length"
    assert reference.finish_reason == "length"
    stop_token = reference.token_ids[2]
    stopped = engine.generate(
        PROMPTS[:1], SamplingConfig(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop_token,))
    )[0][0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == reference.token_ids[: reference.token_ids.index(stop_token) + 1]
    assert len(stopped.logprobs) == len(stopped.token_ids)
    # sampling at temperature 1: n different responses per prompt, in prompt order
    sampled = engine.generate(PROMPTS, SamplingConfig(n=4, temperature=1.0, max_new_tokens=12, ignore_eos=True))
    assert [len(group) for group in sampled] == [4, 4, 4]
    assert len({tuple(c.token_ids) for c in sampled[1]}) > 1
    assert all(c.logprobs and max(c.logprobs) <= 0 for group in sampled for c in group)


def test_a_clipped_budget_is_what_the_engine_asks_sglang_for(engine):
    """--rollout-clip-response-to-context: the 40-token prompt asks for what it leaves of the tiny model's 512-token
    context (SGLang refuses a request past it; its scheduler may stop a request a token or two short of the context,
    as "length"); the 2-token prompt keeps the whole budget."""
    sampling = SamplingConfig(temperature=0.0, max_new_tokens=480, ignore_eos=True, clip_to_context=512)
    (short,), (long,) = engine.generate([PROMPTS[0], PROMPTS[2]], sampling)
    assert len(short.token_ids) == 480 and 470 <= len(long.token_ids) <= 512 - 40
    assert short.finish_reason == long.finish_reason == "length"


def test_a_continued_response_samples_what_its_budget_left_after_its_prefix_as_one_request_would(engine, models):
    """Partial rollout: a response continued from its first tokens (prompt + prefix as the request's input) goes on
    as the uninterrupted request went (greedy), with the logprobs it would have had, for what the response's
    budget left; a complete and an empty prefix stand beside it, one request each."""
    greedy = SamplingConfig(n=3, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    whole = engine.generate(PROMPTS[1:2], greedy)[0][0]
    continued = engine.generate(PROMPTS[1:2], greedy, prefixes=[[whole.token_ids[:3], [], whole.token_ids[:7]]])[0]
    assert [c.token_ids for c in continued] == [whole.token_ids[3:], whole.token_ids, whole.token_ids[7:]]
    assert [c.finish_reason for c in continued] == ["length"] * 3
    assert max(abs(a - b) for a, b in zip(continued[0].logprobs, whole.logprobs[3:])) < 1e-4


def weights(model_dir):
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def test_updated_weights_match_hf(engine, models):
    initial, updated = models
    # tensors packed by the engine's process, a few KiB per bucket: the update goes out in many buckets
    engine.update_weights(weights(updated), bucket_bytes=16 << 10)
    assert_engine_matches_hf(engine, updated)

    # packed by the sender, as a training actor does, and handed over as payloads of shared-memory handles
    engine.begin_weight_update()
    for tensors in split_into_buckets(weights(initial), bucket_bytes=64 << 10):
        bucket, payloads = serialize_bucket(tensors, get_platform("cpu"))
        engine.update_weights_from_serialized_bucket(bucket_specs(bucket), payloads)
    engine.end_weight_update()
    assert_engine_matches_hf(engine, initial)

    # the fallback: a whole checkpoint from disk
    engine.update_weights_from_disk(str(updated))
    assert_engine_matches_hf(engine, updated, steps=4)
    engine.update_weights_from_disk(str(initial))


def test_wrong_buckets_are_refused_naming_the_tensor(engine, models):
    checkpoint = weights(models[0])
    name, tensor = checkpoint[3]
    with pytest.raises(WeightUpdateError, match="need begin_weight_update"):
        engine.update_weights_from_tensor(checkpoint[:1])
    engine.begin_weight_update()
    with pytest.raises(WeightUpdateError, match="tensor 'model.layers.0.self_attn.qkv_proj.weight' is not a tensor"):
        engine.update_weights_from_tensor([checkpoint[0], ("model.layers.0.self_attn.qkv_proj.weight", tensor)])
    with pytest.raises(WeightUpdateError, match=f"tensor '{name}' has shape"):
        engine.update_weights_from_tensor([(name, tensor[:1])])
    with pytest.raises(WeightUpdateError, match=f"tensor '{name}' has shape \\(1, 128\\)"):
        engine.update_weights_from_serialized_bucket([(name, (1, 128))], [b""])
    with pytest.raises(WeightUpdateError, match=f"tensor '{name}' was already sent"):
        engine.update_weights_from_tensor([(name, tensor), (name, tensor)])
    engine.update_weights_from_tensor(checkpoint[:5])  # the current values: the engine's weights do not change
    with pytest.raises(WeightUpdateError, match=f"tensor '{checkpoint[4][0]}' was already sent"):
        engine.update_weights_from_tensor(checkpoint[4:6])
    missing = rf"incomplete weight update: {len(checkpoint) - 5} of {len(checkpoint)} checkpoint tensors"
    with pytest.raises(WeightUpdateError, match=missing):
        engine.end_weight_update()
    assert_engine_matches_hf(engine, models[0], steps=4)


def test_release_and_resume_memory(engine, models):
    engine.release_memory_occupation(["kv_cache", "weights"])
    engine.resume_memory_occupation(["weights"])
    engine.resume_memory_occupation(["kv_cache"])
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.release_memory_occupation(["kv"])
    assert_engine_matches_hf(engine, models[0], steps=4)


def sglang_processes_of_this_test_process():
    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("sglang::")]


def test_a_request_the_engine_refuses_fails_alone_and_the_engine_serves_on(engine):
    context = engine._engine.tokenizer_manager.context_len
    too_long = [(3 * i) % 50 + 3 for i in range(context - 4)]  # with 8 new tokens: more than the context
    sampling = SamplingConfig(n=2, temperature=0.0, max_new_tokens=8, ignore_eos=True)
    answered = engine.generate([PROMPTS[0], too_long, PROMPTS[1]], sampling)
    for refused in answered[1]:
        assert (refused.token_ids, refused.logprobs, refused.finish_reason, refused.text) == ([], [], "error", "")
        assert refused.error.startswith("ValueError: Requested token count exceeds the model's maximum context length")
    # the other requests of the call completed, and the engine answers the next call as before
    again = engine.generate([PROMPTS[0], PROMPTS[1]], sampling)
    for completions, reference in zip([answered[0], answered[2]], again):
        assert [c.token_ids for c in completions] == [c.token_ids for c in reference]
        assert all(c.error is None and c.finish_reason == "length" and len(c.token_ids) == 8 for c in completions)


def test_calls_from_several_threads_run_at_once_and_an_abort_ends_them_keeping_what_they_sampled(engine):
    """Two threads' generations share the engine at once (a Ray actor's concurrent groups); abort_requests ends
    both: their requests come back with finish_reason "abort" and, as SGLang 0.5.23 finishes a running request
    it aborts through its normal output path, with the tokens and logprobs sampled so far."""
    sampling = SamplingConfig(n=4, max_new_tokens=450, ignore_eos=True)  # 8 requests: they all fit the KV pool
    answers = {}
    threads = [
        threading.Thread(target=lambda k=k: answers.__setitem__(k, engine.generate([PROMPTS[k]], sampling)))
        for k in range(2)
    ]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    engine.abort_requests()
    for thread in threads:
        thread.join(timeout=60)
    completions = [c for k in range(2) for c in answers[k][0]]
    assert len(completions) == 8 and {c.finish_reason for c in completions} == {"abort"}
    assert all(c.error is None and len(c.logprobs) == len(c.token_ids) < 450 for c in completions)
    assert any(c.token_ids for c in completions)  # the partial responses survive the abort
    # the engine serves on
    assert {c.finish_reason for c in engine.generate([PROMPTS[0]], SamplingConfig(n=2))[0]} <= {"stop", "length"}


@pytest.mark.timeout(300)
def test_a_dead_engine_raises_and_is_stopped_sparing_the_other_engine(engine, models):
    """A second engine beside the module's: its scheduler dies, the call raises, and the engine is stopped as
    the module's engine is at its end (relax's shutdown, not SGLang's, which kills every child of the process).
    On the CPU both engines' processes are forked from one server that imported SGLang once
    (relax.platform.cpu_sglang), which outlives the second engine while the first runs."""
    before = {p.pid for p in sglang_processes_of_this_test_process()}
    assert set(engine.child_pids) <= before
    server = psutil.Process(engine.child_pids[0]).parent()
    assert server.pid != os.getpid() and {psutil.Process(pid).ppid() for pid in engine.child_pids} == {server.pid}

    second = RolloutEngine(SERVER_ARGS, model_path=str(models[0]), platform=get_platform("cpu"))
    assert {psutil.Process(pid).ppid() for pid in second.child_pids} == {server.pid}
    files = engine_files(second._engine)
    assert any(path.exists() for path in files)
    # the scheduler dies mid-generation, as under the OOM killer: it never answers, the call must not hang
    killer = threading.Timer(0.5, os.kill, (second.child_pids[0], signal.SIGKILL))
    killer.start()
    with pytest.raises(EngineDeadError, match=r"died: its process pid \d+"):
        second.generate(PROMPTS[:2], SamplingConfig(n=8, max_new_tokens=450, ignore_eos=True))
    killer.join()
    assert not any(psutil.pid_exists(pid) for pid in second.child_pids)  # killed and reaped, no zombies
    assert not any(path.exists() for path in files)
    with pytest.raises(EngineDeadError, match="shut down"):
        second.generate(PROMPTS, SamplingConfig())

    # the module's engine lived through it, and the server its processes came from
    assert {p.pid for p in sglang_processes_of_this_test_process()} == before
    assert server.is_running()
    assert_engine_matches_hf(engine, models[0], steps=4)


def test_rollout_on_a_synthetic_task(engine, models, tmp_path):
    data = write_task("copy_digit", 12, tmp_path / "copy_digit.jsonl", seed=3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(models[0])
    prompts, report = load_prompts(PromptDataConfig(str(data), metadata_key="metadata"), tokenizer)
    assert report.kept == 12
    loader = PromptLoader(prompts, seed=0)
    sampling = SamplingConfig(n=4, temperature=1.0, max_new_tokens=4)
    taken = take_prompts(loader, 6)
    samples = generate_and_score(lambda prompts, sampling: engine.generate([p.token_ids for p in prompts], sampling),
                                 taken, sampling, load_reward_fn("copy_digit"))
    assert loader.position.index == 6
    groups = group_by_prompt(samples, 4)
    assert [group.prompt for group in groups] == taken and [len(group.samples) for group in groups] == [4] * 6
    for group in groups:
        for sample in group.samples:
            assert 1 <= len(sample.response_token_ids) == len(sample.response_logprobs) <= 4
            assert sample.response_text == tokenizer.decode(sample.response_token_ids, skip_special_tokens=True)
            assert sample.reward == copy_digit_reward(RewardInput("", sample.response_text, group.prompt.label))
            assert sample.finish_reason in ("stop", "length")
    metrics = reward_and_length_metrics(samples)
    assert len(samples) == 24 and metrics["rollout/reward_failures"] == 0
    assert 0 <= metrics["rollout/reward_mean"] <= 1 and 1 <= metrics["rollout/response_length_mean"] <= 4
