"""Qwen3.5 inside SGLang's engine on one CUDA GPU: SGLang's own GDN decode and relax's fused decode
(SGLANG_RELAX_FUSED_GDN_DECODE=1, relax's sglang patch set) generate the same greedy tokens up to bf16 ties: the
chosen tokens' logprobs agree within LOGPROB_TOLERANCE until the paths part, and where they part, each path's top
two candidates there are closer than TIE_MARGIN (SGLang's top logprobs of each decode step), so either choice is
the argmax within bf16 noise. Decode CUDA graphs on.

The model: relax.tools.tiny_model.qwen3_5_9b_layers(4) (3 GDN layers at Qwen3.5-9B's shapes, 1 full attention), random
bf16 weights built on the device. Needs the GPU verification bundle (docs/gpu-verification.md):
    source tests/gpu/bundle/enter.sh && python3 -m pytest -q -s tests/gpu/test_qwen35_decode_gpu.py
"""

import importlib.util
import os

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="needs sglang (the GPU verification bundle)"),
]

SWITCH = "SGLANG_RELAX_FUSED_GDN_DECODE"
SERVER_FIELDS = dict(attention_backend="triton", sampling_backend="pytorch", disable_prefill_cuda_graph=True,
                     mem_fraction_static=0.5, cuda_graph_max_bs_decode=16, log_level="warning")
NEW_TOKENS = 32
# Both from the H200 run of 2026-12-02 (docs/benchmarks.md): the random model's logprobs sit near -4, where a bf16
# step is 1/32, and the two paths' chosen-token logprobs differed by up to 0.075 (under 3 steps) before any parting;
# every parting came where a path's top two were within 0.047 (3 steps of 1/64 at that magnitude).
LOGPROB_TOLERANCE = 0.1
TIE_MARGIN = 0.05


def greedy_steps(model_dir: str, prompts, fused: bool) -> list[list[tuple[int, float, float]]]:
    """Per prompt, per new token: (token, its logprob, the larger of the top two logprobs' gap)."""
    from relax.platform import get_platform
    from relax.rollout.engine import RolloutEngine

    os.environ[SWITCH] = "1" if fused else "0"  # read by the scheduler process when it imports the model
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    with RolloutEngine(dict(SERVER_FIELDS), model_path=model_dir, platform=get_platform("cuda")) as engine:
        # Top logprobs are not part of relax's Completion: SGLang's own engine answers with them.
        outputs = engine._live().generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                          top_logprobs_num=2)
    steps = []
    for output in outputs:
        chosen, top = output["meta_info"]["output_token_logprobs"], output["meta_info"]["output_top_logprobs"]
        steps.append([(token, logprob, candidates[0][0] - candidates[1][0])
                      for (logprob, token, _), candidates in zip(chosen, top)])
    return steps


def test_fused_gdn_decode_generates_sglangs_greedy_tokens_up_to_bf16_ties(tmp_path):
    from relax.tools.tiny_model import build_tiny_model, qwen3_5_9b_layers

    model_dir = str(build_tiny_model(tmp_path, "qwen3_5", device="cuda", dtype=torch.bfloat16, **qwen3_5_9b_layers(4)))
    torch.cuda.empty_cache()
    prompts = torch.randint(3, 60, (16, 16), generator=torch.Generator().manual_seed(0)).tolist()
    sglang_path, fused_path = (greedy_steps(model_dir, prompts, fused) for fused in (False, True))
    report = []
    for probe, (ours, theirs) in enumerate(zip(fused_path, sglang_path)):
        parted = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a[0] != b[0]), None)
        same = ours[:parted] if parted is not None else ours
        gaps = [abs(a[1] - b[1]) for a, b in zip(same, theirs)]
        report.append({"probe": probe, "parted_at": parted, "max_logprob_gap": max(gaps, default=0.0),
                       "top2_margins_there": None if parted is None else (ours[parted][2], theirs[parted][2])})
    print(report)
    for entry in report:
        assert entry["max_logprob_gap"] < LOGPROB_TOLERANCE, entry
        if entry["parted_at"] is not None:
            assert max(entry["top2_margins_there"]) < TIE_MARGIN, entry
