"""relax's kernels for sgl-kernel-npu (relax.kernels.sgl_kernel_npu, carried into its tree by
patches/sgl-kernel-npu) against their torch references, on CPU with TRITON_INTERPRET=1: the same source the
patches add, run by Triton's interpreter, not on an NPU. tests/gpu/test_sgl_kernel_npu_gpu.py runs the same
checks compiled on a CUDA GPU (their device, shape and grid arguments; the defaults are this file's)."""

import pytest
import torch

from relax.kernels import gdn_reference as ref
from relax.kernels import gdn_sglang_ops, moe_reference
from test_kernels_triton import run_interpreted


# one masked block; three blocks of 1024
SIGMOID_MUL_COLS_AND_DTYPES = ((40, torch.float32), (2100, torch.float16))


def check_sigmoid_mul(device="cpu", rows=5, cols_and_dtypes=SIGMOID_MUL_COLS_AND_DTYPES, num_programs=3):
    from relax.kernels.sgl_kernel_npu.sigmoid_mul import fused_sigmoid_mul, fused_sigmoid_mul_broadcast

    gen = torch.Generator().manual_seed(0)
    for cols, dtype in cols_and_dtypes:
        x = torch.randn(rows, cols + 8, generator=gen).to(device, dtype)[:, :cols]  # strided rows
        gate = torch.randn(rows, cols, generator=gen).to(device, dtype) * 4
        torch.testing.assert_close(fused_sigmoid_mul(x, gate, num_programs=num_programs), ref.sigmoid_mul(x, gate))
        row_gate = torch.randn(rows, 1, generator=gen).to(device, dtype) * 4
        torch.testing.assert_close(fused_sigmoid_mul_broadcast(x, row_gate, num_programs=num_programs),
                                   ref.sigmoid_mul(x, row_gate.expand_as(x)))


def decode_inputs(tokens, seed, hk=2, hv=4, dk=16, dv=12, device="cpu", dtype=torch.float32,
                  state_dtype=torch.float32):
    """SGLang's decode inputs: q, k, v strided views of one conv output [1, T, ...], a and b [T, Hv];
    A_log and dt_bias float32 (as SGLang keeps them), the state pool in state_dtype."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(device, dtype)

    mixed = randn(tokens, 2 * hk * dk + hv * dv)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    return dict(
        A_log=randn(hv, dtype=torch.float32), dt_bias=randn(hv, dtype=torch.float32),
        q=q.view(1, tokens, hk, dk), k=k.view(1, tokens, hk, dk), v=v.view(1, tokens, hv, dv),
        a=randn(tokens, hv, scale=15), b=randn(tokens, hv),  # a crosses softplus's threshold of 20
        initial_state_source=randn(6, hv, dv, dk, scale=0.1, dtype=state_dtype),
    )


def check_gdn_decode(device="cpu", heads_and_dims=(2, 4, 16, 12), block_vs=(8, 32), num_programs=3,
                     dtype=torch.float32, state_dtype=torch.float32, tol=1e-5):
    """heads_and_dims: key heads, value heads, key dim, value dim; block_vs: the state tiles to run (by default
    12 value rows: a tile of 8 and a masked tail, or one masked tile)."""
    from relax.kernels.sgl_kernel_npu.gdn_decode import fused_sigmoid_gating_delta_rule_update_decode_npu

    hk, hv, dk, dv = heads_and_dims
    inputs = dict(hk=hk, hv=hv, dk=dk, dv=dv, device=device, dtype=dtype, state_dtype=state_dtype)
    # a decode batch (one token per sequence, a padding row), then packed sequences of 2, 1 and 3 tokens
    for cu_seqlens, slots in (([0, 1, 2, 3], [4, -1, 0]), ([0, 2, 3, 6], [1, 5, -1])):
        case = decode_inputs(cu_seqlens[-1], seed=len(slots) + cu_seqlens[-1], **inputs)
        expected_pool = case["initial_state_source"].clone()
        bounds = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
        indices = torch.tensor(slots, dtype=torch.int32, device=device)
        for block_v in block_vs:
            pool = expected_pool.clone()
            out = fused_sigmoid_gating_delta_rule_update_decode_npu(
                **{**case, "initial_state_source": pool}, initial_state_indices=indices, cu_seqlens=bounds,
                use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, num_programs=num_programs,
                block_v=block_v)
            reference_pool = expected_pool.clone()
            expected = gdn_sglang_ops.fused_sigmoid_gating_delta_rule_update(
                **{**case, "initial_state_source": reference_pool}, initial_state_indices=indices,
                cu_seqlens=bounds, use_qk_l2norm_in_kernel=True)
            torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
            torch.testing.assert_close(pool, reference_pool, atol=tol, rtol=tol)

    # without cu_seqlens: B sequences of T tokens each
    case = decode_inputs(4, seed=7, **inputs)
    pool, reference_pool = case["initial_state_source"].clone(), case["initial_state_source"].clone()
    batched = {name: case[name].reshape(2, 2, *case[name].shape[2:]) for name in ("q", "k", "v")}
    indices = torch.tensor([3, 0], device=device)
    out = fused_sigmoid_gating_delta_rule_update_decode_npu(
        **{**case, **batched, "initial_state_source": pool}, initial_state_indices=indices,
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, num_programs=num_programs)
    expected = gdn_sglang_ops.fused_sigmoid_gating_delta_rule_update(
        **{**case, "initial_state_source": reference_pool}, initial_state_indices=indices,
        cu_seqlens=torch.tensor([0, 2, 4], device=device), use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(out, expected.reshape(out.shape), atol=tol, rtol=tol)
    torch.testing.assert_close(pool, reference_pool, atol=tol, rtol=tol)


# 12 experts: a masked block of 16
MOE_EXPERTS_AND_TOP_K = ((12, 3), (128, 8))


def check_moe_routing(device="cpu", rows=7, experts_and_top_k=MOE_EXPERTS_AND_TOP_K, num_programs=3):
    from relax.kernels.sgl_kernel_npu.moe_routing import fused_topk

    gen = torch.Generator().manual_seed(2)
    for experts, top_k in experts_and_top_k:
        logits = torch.randn(rows, experts, generator=gen).to(device)  # float32: no two scores tie
        for scoring_func in ("softmax", "sigmoid"):
            for renormalize in (True, False):
                weights, ids = fused_topk(logits, top_k, scoring_func, renormalize, num_programs=num_programs)
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
