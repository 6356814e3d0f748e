"""Torch stand-in for sgl_kernel (the sglang-kernel wheel) on the lent GPU machine. Verification only.

The real wheel (sglang-kernel 0.4.10, `pip install .[cuda]`) is built for torch 2.14.1 and is far larger than a
device call may carry; the lent H200 has torch 2.11. SGLang 0.5.23 imports sgl_kernel ops at module level on CUDA.
With the settings relax's GPU tests use (attention_backend="triton", sampling_backend="pytorch", SGLang's fused ops
in torch: SGLANG_FORCE_FUSED_OP_BACKEND=torch), a dense Qwen3 calls only the norms and activations below.

- IMPLEMENTED: torch versions of those ops, with sgl_kernel's signatures, float32 math like the CUDA kernels.
- IMPORTED_UNCALLED: the other names SGLang's modules import unguarded at module level (found by walking the
  sglang 0.5.23 sources for `from sgl_kernel... import` outside try blocks and functions); each raises
  NotImplementedError, naming itself, if it is ever called.
- Any other name raises AttributeError, so SGLang's guarded feature probes (`try: from sgl_kernel import X`)
  take their fallback, as with a wheel that lacks X.
"""

import sys
import types

import torch

__version__ = "0.4.10+relax.gpu.verification"
__path__ = []  # submodules are the modules made below


def _rms_normalized(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    x32 = x.float()
    scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * scale * (weight.float() + offset)).to(x.dtype)


def _rmsnorm(offset: float):
    def op(input, weight, eps=1e-6, out=None, enable_pdl=None):
        result = _rms_normalized(input, weight, eps, offset)
        return result if out is None else out.copy_(result)

    return op


def _fused_add_rmsnorm(offset: float):
    def op(input, residual, weight, eps=1e-6, enable_pdl=None):
        """In place, like the kernel: residual += input, then input = rmsnorm(residual)."""
        residual.copy_((residual.float() + input.float()).to(residual.dtype))
        input.copy_(_rms_normalized(residual, weight, eps, offset))

    return op


rmsnorm, fused_add_rmsnorm = _rmsnorm(0.0), _fused_add_rmsnorm(0.0)
gemma_rmsnorm, gemma_fused_add_rmsnorm = _rmsnorm(1.0), _fused_add_rmsnorm(1.0)  # Gemma scales by 1 + weight


def _act_and_mul(activation):
    def op(input, out=None, enable_pdl=None):
        half = input.shape[-1] // 2
        result = (activation(input[..., :half].float()) * input[..., half:].float()).to(input.dtype)
        return result if out is None else out.copy_(result)

    return op


silu_and_mul = _act_and_mul(torch.nn.functional.silu)
gelu_and_mul = _act_and_mul(torch.nn.functional.gelu)
gelu_tanh_and_mul = _act_and_mul(lambda x: torch.nn.functional.gelu(x, approximate="tanh"))


def _is_arch_support_pdl(*args, **kwargs) -> bool:
    return False  # programmatic dependent launch is a kernel-launch option; torch ops have none


IMPORTED_UNCALLED = {
    "": (
        "apply_token_bitmask_inplace_cuda assign_draft_cache_locs_contiguous_cpu assign_extend_cache_locs_cpu "
        "assign_req_to_token_pool_cpu build_tree_kernel_efficient build_tree_kernel_efficient_cpu "
        "compress_norm_rope_store concat_mla_k copy_all_layer_kv_cache_cpu cutlass_w4a8_moe_mm "
        "es_fp8_blockwise_scaled_grouped_mm es_sm100_mxfp8_blockscaled_grouped_mm "
        "es_sm100_mxfp8_blockscaled_grouped_quant fill_accept_out_cache_loc_cpu fill_bonus_tokens_cpu "
        "flash_compress128_decode flash_compress128_prefill flash_compress4_decode flash_compress4_prefill "
        "flash_mla_decode flash_mla_decode_get_workspace_size flash_mla_prefill flash_mla_prefill_get_workspace_size "
        "fp8_blockwise_scaled_grouped_mm fp8_mqa_logits fp8_paged_mqa_logits fused_inplace_qknorm_rope "
        "fused_k_norm_rope_flashmla fused_q_norm_rope gdn_attention gelu_quick get_cutlass_w4a8_moe_mm_data "
        "infllmv2_attn_stage1 int8_scaled_mm load_cache_to_device_buffer_dsv4_mla load_cache_to_device_buffer_mla "
        "max_pooling_1d_varlen merge_state_v2 min_p_sampling_from_probs moe_sum moe_sum_reduce plan_compress_decode "
        "plan_compress_decode_legacy plan_compress_prefill plan_compress_prefill_legacy rotate_input_ids_cpu "
        "sgl_per_tensor_quant_fp8 sgl_per_token_quant_fp8 shuffle_rows store_cache_xpu top_k_renorm_prob "
        "top_k_top_p_sampling_from_probs top_p_renorm_prob topk_sigmoid topk_softmax verify_tree_greedy_cpu "
        "weak_ref_tensor"
    ),
    "flash_attn": "flash_attn_varlen_func flash_attn_with_kvcache",
    "kvcacheio": (
        "transfer_embedding_ranges_direct transfer_kv_all_layer transfer_kv_all_layer_direct_lf_pf "
        "transfer_kv_all_layer_lf_pf transfer_kv_all_layer_lf_ph transfer_kv_all_layer_mla "
        "transfer_kv_all_layer_mla_lf_pf transfer_kv_direct transfer_kv_per_layer transfer_kv_per_layer_direct_pf_lf "
        "transfer_kv_per_layer_mla transfer_kv_per_layer_mla_pf_lf transfer_kv_per_layer_pf_lf "
        "transfer_kv_per_layer_ph_lf"
    ),
    "mamba": "causal_conv1d_fn_cpu causal_conv1d_update_cpu chunk_gated_delta_rule_cpu",
    "quantization": "ggml_dequantize ggml_moe_a8 ggml_moe_a8_vec ggml_mul_mat_a8 ggml_mul_mat_vec_a8",
    "speculative": "reconstruct_indices_from_tree_mask",
    "elementwise": "",
    "utils": "",
}


def _uncallable(qualified_name: str):
    def op(*args, **kwargs):
        raise NotImplementedError(
            f"{qualified_name} is not in relax's GPU-verification stand-in for sgl_kernel (tests/gpu/bundle); "
            "install the real sglang-kernel (pip install .[cuda]) to run this SGLang path"
        )

    op.__qualname__ = qualified_name
    return op


def _serve(module: types.ModuleType, names: str) -> None:
    for name in names.split():
        setattr(module, name, _uncallable(f"{module.__name__}.{name}"))


_serve(sys.modules[__name__], IMPORTED_UNCALLED[""])
for _submodule, _names in IMPORTED_UNCALLED.items():
    if _submodule:
        _module = types.ModuleType(f"{__name__}.{_submodule}")
        _module.__path__ = []
        _serve(_module, _names)
        sys.modules[_module.__name__] = _module
        setattr(sys.modules[__name__], _submodule, _module)
utils.is_arch_support_pdl = _is_arch_support_pdl  # noqa: F821 (made by the loop above)
for _name in ("rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm", "gemma_fused_add_rmsnorm", "silu_and_mul",
              "gelu_and_mul", "gelu_tanh_and_mul"):
    setattr(elementwise, _name, globals()[_name])  # noqa: F821 (sgl_kernel.elementwise re-exports them)
