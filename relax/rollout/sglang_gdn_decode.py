"""SGLang 0.5.23 glue for the fused GDN decode kernel: what patches/sglang/0004 calls from Qwen3.5's GDN layer.

With SGLANG_RELAX_FUSED_GDN_DECODE=1 the patched `Qwen3_5GatedDeltaNet.forward` hands a decode batch's input
projections to `qwen3_5_decode`, which runs relax.kernels.gdn_triton.gdn_decode (QKVZBA split, conv-state update,
q/k l2norm, gating, delta rule, gated RMSNorm: one launch) on the engine's own state pools and returns the
gated-norm output, ready for out_proj. SGLang's path for the same step is its split kernel, causal_conv1d_update,
its recurrent kernel (gating fused in) and RMSNormGated: several launches and round trips through memory.

`qwen3_5_decode` returns None when a batch is not plain decode work this kernel serves (speculative decoding,
replay-SSM rings, quantised activations, rows that do not match the slot table, another activation): the model
then runs SGLang's own path unchanged, and the reason is logged once. All layout knowledge lives here, so the
patch stays a switch and one call:
- projections: Qwen3.5's contiguous [q | k | v | z] and [b | a] of this TP rank (`layout="contiguous"`);
- conv state pool: [num_slots, conv_dim, W-1] on CUDA and CPU, [num_slots, W-1, conv_dim] on Ascend (the NPU
  pool is window-major); both are handed to the kernel as a [num_slots, conv_dim, W-1] view with its strides;
- recurrent state pool: [num_slots, Hv, V, K], the kernel's own layout; padding rows carry slot -1;
- launch: relax.kernels.launch's record for the device's Triton target and compute units (facts of its platform),
  turned per batch by gdn_triton.decode_tiling into block_v and programs_per_group (small batches split each key
  head's group over programs), with one persistent tickets buffer per device for the split launches.
"""

import functools
import logging

import torch

from relax.kernels.gdn_triton import decode_tiling, gdn_decode
from relax.kernels.launch import TritonLaunch
from relax.platform import platform_facts

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=None)
def launch_for_device(device: torch.device) -> TritonLaunch:
    """The launch record for `device`: its platform's Triton target and compute units, through the target's tuning
    (relax.kernels.launch: SMs x 16 programs with 4 warps and the H200's decode tiling on NVIDIA, one program per
    vector core on Ascend, a few programs under TRITON_INTERPRET on the CPU)."""
    platform = platform_facts(device.type)
    try:
        return platform.triton_launch(device.index or 0)
    except RuntimeError as error:
        raise RuntimeError(f"SGLANG_RELAX_FUSED_GDN_DECODE=1 on {device}: {error}; or unset the variable") from error


@functools.lru_cache(maxsize=None)
def tickets_for_device(device: torch.device) -> torch.Tensor:
    """The one arrival-ticket buffer every split gdn_decode call on `device` shares (the kernel leaves it zero).
    Allocated once, at the first decode step, which SGLang runs in a CUDA-graph warm-up before any capture, so
    captured graphs and eager steps all use the same buffer. decode_tiling splits only batches whose
    rows x key heads fit in decode_split_items, so that many tickets serve every batch and layer. Layers and steps
    run one after another on one stream; two split launches in flight at once on one device (two streams) would
    share the tickets."""
    return torch.zeros(max(1, launch_for_device(device).decode_split_items), dtype=torch.int32, device=device)


def fused_decode(projected_qkvz, projected_ba, conv_pool, conv_weight, conv_bias, ssm_states, cache_indices, A_log,
                 dt_bias, norm_weight, norm_eps, num_k_heads, head_k_dim, head_v_dim) -> torch.Tensor:
    """gdn_decode on SGLang's contiguous projections and pools, with the tiling decode_tiling chooses for this
    batch on this device and the device's persistent tickets: [N, Hv, V]."""
    device = projected_qkvz.device
    tiling = decode_tiling(projected_qkvz.shape[0], num_k_heads, A_log.shape[0], head_v_dim,
                           launch_for_device(device))
    _log_once(logging.INFO, f"relax fused GDN decode tiling in use: {tiling.describe()}")
    return gdn_decode(
        projected_qkvz, projected_ba, conv_pool, conv_weight, conv_bias, ssm_states, cache_indices, A_log, dt_bias,
        norm_weight, norm_eps, num_k_heads=num_k_heads, head_k_dim=head_k_dim, head_v_dim=head_v_dim,
        layout="contiguous", launch=tiling.launch, block_v=tiling.block_v,
        programs_per_group=tiling.programs_per_group, tickets=tickets_for_device(device),
    )


def conv_pool_as_channels_by_taps(conv_states: torch.Tensor, conv_dim: int, width: int) -> torch.Tensor | None:
    """SGLang's conv state pool as the kernel's [num_slots, conv_dim, W-1] view (no copy), or None if it is
    neither [num_slots, conv_dim, W-1] nor Ascend's window-major [num_slots, W-1, conv_dim]."""
    if conv_states.dim() != 3:
        return None
    if conv_states.shape[1:] == (conv_dim, width - 1):
        return conv_states
    if conv_states.shape[1:] == (width - 1, conv_dim):
        return conv_states.transpose(1, 2)
    return None


@functools.lru_cache(maxsize=None)
def _log_once(level: int, message: str) -> None:
    logger.log(level, message)


def _fall_back(reason: str) -> None:
    _log_once(logging.WARNING, f"relax fused GDN decode: SGLang's own decode path runs instead: {reason}")
    return None


def _linear_attention_backend():
    from sglang.srt.model_executor.forward_context import get_attn_backend

    backend = get_attn_backend()
    return getattr(backend, "linear_attn_backend", backend)  # HybridLinearAttnBackend wraps the GDN backend


def qwen3_5_decode(module, forward_batch, projected_qkvz, projected_ba) -> torch.Tensor | None:
    """One decode step of a Qwen3_5GatedDeltaNet layer (`module`) from its input projections.

    projected_qkvz [N, q+k+v+z of this rank], projected_ba [N, 2*Hv of this rank]. Updates the layer's conv and
    recurrent state pools in place, keeps SGLang's prefix-cache state tracking, and returns the gated-norm
    output [N, Hv * V] for out_proj; or None (logged once per reason) for SGLang's own path to run instead.
    """
    if not forward_batch.forward_mode.is_decode():
        return None  # prefill, mixed and speculative-verify batches keep SGLang's kernels
    if not (isinstance(projected_qkvz, torch.Tensor) and isinstance(projected_ba, torch.Tensor)):
        return _fall_back("the input projections are quantised tuples, not plain tensors")
    attn, norm = module.attn, module.norm
    if attn.activation not in ("silu", "swish") or getattr(norm, "activation", "silu") not in ("silu", "swish"):
        return _fall_back(f"activations conv={attn.activation!r} norm={getattr(norm, 'activation', None)!r}: "
                          "the kernel applies silu")
    if getattr(norm, "group_size", None) is not None or not getattr(norm, "norm_before_gate", True):
        return _fall_back("the gated norm is grouped or gates before normalising; the kernel normalises whole "
                          "heads before the gate")

    backend = _linear_attention_backend()
    metadata = backend.forward_metadata
    if getattr(metadata, "replayssm_write_pos", None) is not None:
        return _fall_back("--enable-linear-replayssm keeps decode states in rings this kernel does not write")
    layer_cache = backend.req_to_token_pool.mamba2_layer_cache(attn.layer_id)
    conv_states, ssm_states = layer_cache.conv[0], layer_cache.temporal
    cache_indices = metadata.mamba_cache_indices
    rows = projected_qkvz.shape[0]
    if cache_indices.shape != (rows,):
        return _fall_back(f"{rows} projected rows but a slot table of shape {tuple(cache_indices.shape)}")
    conv_dim = attn.q_dim + attn.k_dim + attn.v_dim
    conv_pool = conv_pool_as_channels_by_taps(conv_states, conv_dim, attn.conv_weights.shape[-1])
    if conv_pool is None:
        return _fall_back(f"conv state pool of shape {tuple(conv_states.shape)} is not [slots, {conv_dim}, W-1] "
                          f"nor [slots, W-1, {conv_dim}]")
    if not ssm_states[0].is_contiguous():
        return _fall_back("the recurrent state pool's slots are not contiguous [Hv, V, K] blocks")

    launch = launch_for_device(projected_qkvz.device)
    _log_once(logging.INFO, f"relax fused GDN decode serves Qwen3.5 GDN decode steps ({launch})")
    out = fused_decode(projected_qkvz, projected_ba, conv_pool, attn.conv_weights, attn.bias, ssm_states,
                       cache_indices, attn.A_log, attn.dt_bias, norm.weight, norm.eps, attn.num_k_heads,
                       attn.head_k_dim, attn.head_v_dim)
    # What SGLang's decode does after its recurrent kernel: copy states to the prefix cache's track slots.
    backend._track_mamba_state_decode(forward_batch, conv_states, ssm_states, cache_indices, attn.layer_id)
    return out.reshape(rows, -1)
