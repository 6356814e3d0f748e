"""relax's kernels for sgl-kernel-npu (relax.kernels.sgl_kernel_npu, carried into its tree by
patches/sgl-kernel-npu) against their torch references, on CPU with TRITON_INTERPRET=1: the same source the
patches add, run by Triton's interpreter, not on an NPU."""

import pytest
import torch

from relax.kernels import gdn_reference as ref
from relax.kernels import gdn_sglang_ops, moe_reference
from test_kernels_triton import run_interpreted


def check_sigmoid_mul():
    from relax.kernels.sgl_kernel_npu.sigmoid_mul import fused_sigmoid_mul, fused_sigmoid_mul_broadcast

    gen = torch.Generator().manual_seed(0)
    for cols, dtype in ((40, torch.float32), (2100, torch.float16)):  # one masked block; three blocks of 1024
        x = torch.randn(5, cols + 8, generator=gen).to(dtype)[:, :cols]  # strided rows
        gate = torch.randn(5, cols, generator=gen).to(dtype) * 4
        torch.testing.assert_close(fused_sigmoid_mul(x, gate, num_programs=3), ref.sigmoid_mul(x, gate))
        row_gate = torch.randn(5, 1, generator=gen).to(dtype) * 4
        torch.testing.assert_close(fused_sigmoid_mul_broadcast(x, row_gate, num_programs=3),
                                   ref.sigmoid_mul(x, row_gate.expand_as(x)))


def decode_inputs(tokens, seed, hk=2, hv=4, dk=16, dv=12):
    """SGLang's decode inputs: q, k, v strided views of one conv output [1, T, ...], a and b [T, Hv]."""
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, 2 * hk * dk + hv * dv, generator=gen)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return dict(
        A_log=torch.randn(hv, generator=gen), dt_bias=torch.randn(hv, generator=gen),
        q=q.view(1, tokens, hk, dk), k=k.view(1, tokens, hk, dk), v=v.view(1, tokens, hv, dv),
        a=torch.randn(tokens, hv, generator=gen) * 15, b=torch.randn(tokens, hv, generator=gen),  # a crosses 20
        initial_state_source=torch.randn(6, hv, dv, dk, generator=gen) * 0.1,
    )


def check_gdn_decode():
    from relax.kernels.sgl_kernel_npu.gdn_decode import fused_sigmoid_gating_delta_rule_update_decode_npu

    # a decode batch (one token per sequence, a padding row), then packed sequences of 2, 1 and 3 tokens
    for cu_seqlens, slots in (([0, 1, 2, 3], [4, -1, 0]), ([0, 2, 3, 6], [1, 5, -1])):
        case = decode_inputs(cu_seqlens[-1], seed=len(slots) + cu_seqlens[-1])
        expected_pool = case["initial_state_source"].clone()
        bounds, indices = torch.tensor(cu_seqlens, dtype=torch.int32), torch.tensor(slots, dtype=torch.int32)
        for block_v in (8, 32):  # 12 value rows: a tile of 8 and a masked tail, or one masked tile
            pool = expected_pool.clone()
            out = fused_sigmoid_gating_delta_rule_update_decode_npu(
                **{**case, "initial_state_source": pool}, initial_state_indices=indices, cu_seqlens=bounds,
                use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, num_programs=3,
                block_v=block_v)
            reference_pool = expected_pool.clone()
            expected = gdn_sglang_ops.fused_sigmoid_gating_delta_rule_update(
                **{**case, "initial_state_source": reference_pool}, initial_state_indices=indices,
                cu_seqlens=bounds, use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pool, reference_pool, atol=1e-5, rtol=1e-5)

    # without cu_seqlens: B sequences of T tokens each
    case = decode_inputs(4, seed=7)
    pool, reference_pool = case["initial_state_source"].clone(), case["initial_state_source"].clone()
    batched = {name: case[name].reshape(2, 2, *case[name].shape[2:]) for name in ("q", "k", "v")}
    indices = torch.tensor([3, 0])
    out = fused_sigmoid_gating_delta_rule_update_decode_npu(
        **{**case, **batched, "initial_state_source": pool}, initial_state_indices=indices,
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, num_programs=2)
    expected = gdn_sglang_ops.fused_sigmoid_gating_delta_rule_update(
        **{**case, "initial_state_source": reference_pool}, initial_state_indices=indices,
        cu_seqlens=torch.tensor([0, 2, 4]), use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, expected.reshape(out.shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool, reference_pool, atol=1e-5, rtol=1e-5)


def check_moe_routing():
    from relax.kernels.sgl_kernel_npu.moe_routing import fused_topk

    gen = torch.Generator().manual_seed(2)
    for experts, top_k in ((12, 3), (128, 8)):  # 12 experts: a masked block of 16
        logits = torch.randn(7, experts, generator=gen)  # float32: no two scores tie
        for scoring_func in ("softmax", "sigmoid"):
            for renormalize in (True, False):
                weights, ids = fused_topk(logits, top_k, scoring_func, renormalize, num_programs=3)
                expected_weights, expected_ids = moe_reference.route_topk(logits, top_k, scoring_func, renormalize)
                assert ids.dtype == torch.int32 and torch.equal(ids.long(), expected_ids)
                torch.testing.assert_close(weights, expected_weights)


@pytest.mark.parametrize("check", ["check_sigmoid_mul", "check_gdn_decode", "check_moe_routing"])
def test_kernel_matches_its_reference_interpreted(check):
    run_interpreted(check, module=__name__)


def test_gdn_decode_refuses_speculative_target_verify():
    from relax.kernels.sgl_kernel_npu.gdn_decode import fused_sigmoid_gating_delta_rule_update_decode_npu

    case = decode_inputs(2, seed=0)
    with pytest.raises(NotImplementedError, match="speculative"):
        fused_sigmoid_gating_delta_rule_update_decode_npu(
            **case, initial_state_indices=torch.tensor([0, 1]), cu_seqlens=torch.tensor([0, 1, 2]),
            softplus_beta=1.0, softplus_threshold=20.0, disable_state_update=True,
            intermediate_states_buffer=torch.zeros(1), cache_steps=2, num_programs=1)


def test_grid_needs_num_programs_off_an_npu():
    from relax.kernels.sgl_kernel_npu.moe_routing import fused_topk

    with pytest.raises(ValueError, match="num_programs"):
        fused_topk(torch.randn(2, 8), 2)
