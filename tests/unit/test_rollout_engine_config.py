"""relax.rollout.engine's and relax.rollout.engine_fields' checks that need no running engine (the engine itself:
tests/e2e/test_engine.py)."""

import base64
import dataclasses

import numpy as np
import pytest
import torch

from relax.hf_checkpoint.architecture import FAMILIES
from relax.platform import get_platform
from relax.rollout.engine import (
    RolloutEngine,
    SamplingConfig,
    _completion,
    _chosen_fields,
    decode_routed_experts,
    request_params,
)
from relax.rollout.engine_fields import (
    AdmissionBudget, admission_holdback, rollout_decode_graph_fields, server_defaults,
)
from relax.rollout.sglang_models import SGLANG_MODULES


def test_sampling_config_checks_and_sglang_params():
    with pytest.raises(ValueError, match=r"n=0 \(must be >= 1\), top_p=0 \(must be in \(0, 1\]\), top_k=0"):
        SamplingConfig(n=0, top_p=0, top_k=0)
    sampling = SamplingConfig(temperature=0.7, top_k=5, max_new_tokens=9, stop_token_ids=(2,), stop=("\n",))
    params = sampling.sglang_params()
    assert params == {"temperature": 0.7, "top_p": 1.0, "top_k": 5, "max_new_tokens": 9, "stop_token_ids": [2],
                      "stop": ["\n"], "ignore_eos": False}


def test_each_request_gets_its_seed_and_the_budget_its_prompt_leaves_of_the_context():
    clipped = SamplingConfig(n=2, max_new_tokens=9, seed=100, clip_to_context=12)
    params = request_params([[1, 2], [1, 2], [1, 2, 3, 4, 5], [1, 2, 3, 4, 5]], clipped)
    assert [(p["sampling_seed"], p["max_new_tokens"]) for p in params] == [(100, 9), (101, 9), (102, 7), (103, 7)]
    (unseeded,) = request_params([[1, 2, 3, 4, 5]], SamplingConfig(max_new_tokens=9))
    assert unseeded == SamplingConfig(max_new_tokens=9).sglang_params()  # no seed, not clipped


def test_managed_fields_are_refused_from_the_sglang_namespace(tmp_path):
    cpu = get_platform("cpu")
    with pytest.raises(ValueError, match=r"SGLang field tp_size=2 is managed by relax \(relax sets 1\)"):
        RolloutEngine({"tp_size": 2}, model_path=str(tmp_path), platform=cpu)
    with pytest.raises(ValueError, match="memory saver was asked for, but platform 'cpu' has none"):
        RolloutEngine({}, model_path=str(tmp_path), platform=cpu, enable_memory_saver=True)


def test_chosen_fields_put_platform_defaults_under_a_dict_but_take_a_server_args_as_it_is():
    cpu = get_platform("cpu")
    cpu.prepare_sglang()
    from sglang.srt.server_args import ServerArgs

    # relax.args built this one, defaults applied: a field left at SGLang's default (log_level "info", which a
    # user gave) stays there rather than taking relax's default ("warning") again.
    server_args = ServerArgs(model_path="m", tp_size=1, max_total_tokens=1024, log_level="info")
    assert _chosen_fields(server_args, cpu) == {"max_total_tokens": 1024}
    chosen = _chosen_fields({"dtype": "auto", "max_total_tokens": 512}, cpu)
    assert chosen["dtype"] == "auto" and chosen["max_total_tokens"] == 512
    assert chosen["attention_backend"] == "torch_native" and chosen["log_level"] == "warning"


def test_completion_from_sglang_output():
    output = {
        "text": "ab",
        "meta_info": {"finish_reason": {"type": "stop", "matched": 2},
                      "output_token_logprobs": [(-0.5, 13, None), (-0.25, 14, None), (-1.0, 2, None)]},
    }
    completion = _completion(output, [7, 8], None)
    assert (completion.token_ids, completion.logprobs, completion.finish_reason, completion.text) == (
        [13, 14, 2], [-0.5, -0.25, -1.0], "stop", "ab")
    assert completion.routed_experts is None


def _encoded(ids: np.ndarray) -> str:
    """As SGLang's detokenizer sends routed experts: base64 of the int32 bytes."""
    return base64.b64encode(ids.astype(np.int32).tobytes()).decode()


def test_routed_experts_cover_every_token_but_the_last_as_layers_by_top_k():
    # a 2-token prompt and a 3-token response: 4 tokens ran forward, 2 layers, top-2
    ids = np.arange(4 * 2 * 2) % 7
    output = {"meta_info": {"output_token_logprobs": [(-0.5, 13, None), (-0.25, 14, None), (-1.0, 2, None)],
                            "routed_experts": _encoded(ids)}}
    completion = _completion(output, [7, 8], (2, 2))
    assert completion.routed_experts.dtype == torch.int16
    assert torch.equal(completion.routed_experts, torch.from_numpy(ids).reshape(4, 2, 2).to(torch.int16))
    assert completion.routed_experts[2, 1].tolist() == ids[2 * 4 + 1 * 2 : 2 * 4 + 2 * 2].tolist()


def test_routed_experts_of_the_wrong_length_are_refused():
    with pytest.raises(RuntimeError, match=r"returned 12 routed-expert ids for a sequence of 5 tokens; expected 16"):
        decode_routed_experts(_encoded(np.zeros(12)), 5, (2, 2))


def test_decode_graph_sizes_for_engine_fields_given_as_a_dict():
    """As benchmarks/rollout_throughput_gpu.py passes its engines' fields (relax.args passes a ServerArgs' fields:
    tests/unit/test_args_sglang.py)."""
    gpu = {"attention_backend": "triton", "disable_prefill_cuda_graph": True}
    assert rollout_decode_graph_fields(gpu, 1024) == {"cuda_graph_max_bs_decode": 1024}
    assert rollout_decode_graph_fields({**gpu, "max_running_requests": 300}, 1024) == {"cuda_graph_max_bs_decode": 300}
    assert rollout_decode_graph_fields({**gpu, "cuda_graph_bs_decode": [1, 8]}, 1024) == {}
    assert rollout_decode_graph_fields({**gpu, "cuda_graph_backend_decode": "disabled"}, 1024) == {}
    assert rollout_decode_graph_fields(server_defaults(get_platform("cpu")), 1024) == {}


def test_the_requests_sglang_would_hold_back_at_a_rollouts_start_are_reported_with_the_setting_that_starts_them():
    """The H100 run of benchmarks/rollout_long_tail.py (docs/benchmarks.md): one engine's KV cache of 413,099
    tokens, responses of up to 2,048 tokens. Over-sampling's 512 requests overflow SGLang's reservation; sync's 256,
    or 512 at a conservativeness of 0.3, or 512 behind a cap of 256 running requests, do not."""
    h100 = AdmissionBudget(kv_cache_tokens=413_099, conservativeness=1.0, init_ratio=0.7, reserve_clip=4096,
                           max_running_requests=2048)
    holdback = admission_holdback(h100, 512, 2048)
    assert holdback.startswith("SGLang starts about 288 of the 512 requests an engine runs at once in a rollout")
    assert "reserves 0.70 x min(--rollout-max-response-len, 4096) = 1434 of them" in holdback
    assert "--sglang-schedule-conservativeness 0.56 or less starts them all" in holdback
    assert admission_holdback(h100, 256, 2048) is None
    assert admission_holdback(dataclasses.replace(h100, conservativeness=0.3), 512, 2048) is None
    assert admission_holdback(dataclasses.replace(h100, max_running_requests=256), 512, 2048) is None
    assert admission_holdback(dataclasses.replace(h100, conservativeness=0.0), 512, 2048) is None  # reserves none
    # The reservation stops at SGLang's clip, and at a ratio of 1 however conservative.
    clipped = admission_holdback(dataclasses.replace(h100, conservativeness=2.0), 512, 8192)
    assert "reserves 1.00 x min(--rollout-max-response-len, 4096) = 4096 of them" in clipped
    assert "starts about 100 of the 512" in clipped and "conservativeness 0.28 or less" in clipped


def test_the_engines_model_package_has_every_architecture_relax_trains():
    """SGLang's registry in relax's engines imports these classes up front (relax.rollout.sglang_models); a family's
    class missing here would still load, but with all of SGLang's model modules."""
    trained = {family.architecture for family in FAMILIES.values()}
    trained |= {family.vision_language[1] for family in FAMILIES.values() if family.vision_language}
    assert set(SGLANG_MODULES) == trained
