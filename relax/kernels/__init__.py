"""Gated DeltaNet (GDN) operators for Qwen3.5 / Qwen3-Next: plain-torch references and Triton kernels.

Modules
- gdn_reference: readable float32 torch for every op (the definition; differentiable, so the chunked forward
  trains on CPU through autograd). Layouts and their conversions are documented at its top.
- gdn_triton: the fused decode kernel (split + conv update + l2norm + gating + delta rule + gated norm, one
  launch over the slot-indexed pools) and Triton versions of the conv update, gating and gated norm, written to
  triton-ascend's porting rules. Launch settings come from a TritonLaunch record.
- launch: the TritonLaunch record and each Triton target's launch tuning (NVIDIA as measured on an H200, Ascend,
  the interpreter), scaled to a device's compute units.
- gdn_sglang_ops: functions with the semantics of the sgl_kernel CPU ops SGLang 0.5.23 calls for GDN models.
- sgl_kernel_npu: Triton kernels for SGLang's Ascend path (the sigmoid-gated GDN decode update, the sigmoid gate,
  the MoE routing front), self-contained so patches/sgl-kernel-npu carries them into sgl-kernel-npu as they are;
  gdn_triton takes its gating and delta-rule tile update from there.
- moe_reference: the MoE routing front (softmax or sigmoid scores, top-k, renormalised) in torch.

SGLang's Qwen3.5 decode reaches gdn_triton.gdn_decode through relax.rollout.sglang_gdn_decode (patches/sglang/0004).

Pools (decode): recurrent state [num_slots, Hv, V, K] (SGLang's layout; HF / fla hand states around as
[.., Hv, K, V]: gdn_reference.state_to_pool_layout / state_from_pool_layout), conv state [num_slots, conv_dim,
W-1] (HF's cache keeps W columns: conv_state_from_hf / conv_state_to_hf). A negative slot marks a padding row:
skipped, zero output.

Stand-ins for the libraries Megatron-core 0.16.1's GatedDeltaNet imports (megatron/core/ssm/gated_delta_net.py):
    fla.ops.gated_delta_rule.chunk_gated_delta_rule -> gdn_reference.chunk_gated_delta_rule (backward by autograd)
    fla.modules.l2norm.l2norm                        -> gdn_reference.l2norm
    causal_conv1d.causal_conv1d_fn                   -> gdn_reference.causal_conv1d
    fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule -> gdn_reference.recurrent_gated_delta_rule

sgl_kernel CPU op (torch.ops.sgl_kernel.*)          relax function (gdn_sglang_ops.*, same argument order)
    fused_sigmoid_mul_cpu                             fused_sigmoid_mul                  (in place on x)
    fused_qk_gemma_rmsnorm_cpu                        fused_qk_gemma_rmsnorm
    fused_qk_gemma_rmsnorm_with_gate_cpu              fused_qk_gemma_rmsnorm_with_gate
    fused_qkvzba_split_reshape_cat_contiguous_cpu     fused_qkvzba_split_reshape_cat_contiguous  (Qwen3.5)
    fused_qkvzba_split_reshape_cat_cpu                fused_qkvzba_split_reshape_cat     (Qwen3-Next)
    fused_rmsnorm_gated_cpu                           fused_rmsnorm_gated
    fused_gdn_gating_cpu                              fused_gdn_gating
    causal_conv1d_fwd_cpu                             causal_conv1d_fwd
    causal_conv1d_update_cpu                          causal_conv1d_update
    chunk_gated_delta_rule_cpu                        chunk_gated_delta_rule
    fused_sigmoid_gating_delta_rule_update_cpu        fused_sigmoid_gating_delta_rule_update
"""
