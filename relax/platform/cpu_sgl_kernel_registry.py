"""Torch implementations of the sgl_kernel CPU ops that SGLang 0.5.23's CPU engine calls.

PyPI's sgl-kernel wheel is CUDA-only (no CPU ops, no sdist), so on the CPU platform relax puts a stand-in
`sgl_kernel` package first on the path (relax/platform/cpu_stand_ins/sgl_kernel). The stand-in serves
the ops registered here and, for any other name SGLang imports, a function that raises
NotImplementedError naming the op when called: SGLang imports many ops at module level that its
CPU path never calls, so importing must succeed and only calling may fail.

Register more ops with `register_cpu_op` at the bottom of this module (this module is what the
stand-in imports in every process, including SGLang's spawned scheduler):
- `submodule="mamba"` serves `from sgl_kernel.mamba import name`;
- `schema="(Tensor x) -> Tensor"` also defines `torch.ops.sgl_kernel.<name>` (SGLang reads some ops,
  e.g. fused_sigmoid_mul_cpu in models/qwen3_5.py, from the torch op namespace).
"""

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch


@dataclass(frozen=True)
class CpuOp:
    name: str
    function: Callable
    submodule: str  # "" for the top-level sgl_kernel module
    schema: Optional[str]  # torch op schema without the name, or None for a Python-only op


CPU_OPS: Dict[str, CpuOp] = {}


def register_cpu_op(name: str, function: Callable, submodule: str = "", schema: Optional[str] = None) -> None:
    if name in CPU_OPS:
        raise ValueError(f"sgl_kernel CPU op {name!r} is registered twice")
    CPU_OPS[name] = CpuOp(name, function, submodule, schema)


def missing_op(qualified_name: str) -> Callable:
    """What the stand-in serves for an op nobody implemented: fails when called, naming the op.
    Dunder names are never ops: they raise AttributeError, as on any module."""
    if qualified_name.rpartition(".")[2].startswith("__"):
        raise AttributeError(qualified_name)

    def not_implemented(*args, **kwargs):
        raise NotImplementedError(
            f"{qualified_name} is not available on relax's CPU platform: PyPI's sgl-kernel has no CPU ops "
            "and relax implements only the ones SGLang's CPU engine calls for the supported models. "
            "Implement it in torch and register it with relax.platform.cpu_sgl_kernel_registry.register_cpu_op."
        )

    not_implemented.__name__ = qualified_name.rpartition(".")[2]
    not_implemented.__qualname__ = qualified_name
    return not_implemented


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    Request i owns req_to_token[req_pool_indices[i], start_offset[i]:end_offset[i]]; its slots are the
    next end-start entries of out_cache_loc, which holds all requests' new slots back to back (the
    semantics of the Triton kernel assign_req_to_token_pool in sglang/srt/mem_cache/allocation.py).
    """
    if req_to_token.shape[1] != pool_len:
        raise ValueError(f"pool_len {pool_len} does not match req_to_token's row length {req_to_token.shape[1]}")
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        req_to_token[row, start:end] = out_cache_loc[taken : taken + count].to(req_to_token.dtype)
        taken += count


register_cpu_op("assign_req_to_token_pool_cpu", assign_req_to_token_pool_cpu)


_MASK32 = 0xFFFFFFFF


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _murmur3_mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    k = _rotl32((k * 0xCC9E2D51) & _MASK32, 15)
    k = (k * 0x1B873593) & _MASK32
    return (_rotl32(h ^ k, 13) * 5 + 0xE6546B64) & _MASK32


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """MurmurHash3 (32-bit) of each (seed, position, column) as uint32 [rows, cols]: the semantics of SGLang's
    Triton murmur_hash32_kernel (sglang/kernels/ops/sampling/murmur_hash.py), which seeded sampling hashes into
    Gumbel noise. int64 arithmetic masked to 32 bits: products wrap modulo 2**64, their low 32 bits are exact."""
    seed = seed.to(torch.int64).view(-1, 1)
    h = torch.zeros_like(seed)
    for block in (seed & _MASK32, (seed >> 32) & _MASK32, positions.to(torch.int64).view(-1, 1) & _MASK32):
        h = _murmur3_mix(h, block)
    h = _murmur3_mix(h, col_indices.to(torch.int64).view(1, -1) & _MASK32) ^ 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return h.to(torch.uint32)


register_cpu_op(
    "murmur_hash32_cpu", murmur_hash32_cpu, schema="(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor"
)


# ----------------------------------------------------------------------------------------------------------
# Gated DeltaNet (Qwen3.5 / Qwen3-Next): the ops SGLang 0.5.23 calls on the CPU engine, served by
# relax.kernels.gdn_sglang_ops (torch references; argument order as SGLang passes them). Those read as
# torch.ops.sgl_kernel.<name> get a schema (SGLang's models and GDN backend bind them at import); `(a!)` marks
# the pools they update in place. The three `sgl_kernel.mamba` functions are Python-level wrappers in
# sgl-kernel, called with keywords by sglang/srt/layers/attention/linear/gdn_backend.py and
# kernels/gdn_triton.py; they call relax's conv / chunk functions directly (SGLang never reads
# causal_conv1d_fwd_cpu / causal_conv1d_update_cpu / chunk_gated_delta_rule_cpu from torch.ops).
# ----------------------------------------------------------------------------------------------------------
from relax.kernels import gdn_sglang_ops as _gdn  # noqa: E402  (this section only)

# SGLang's PAD_SLOT_ID (sglang/srt/layers/attention/mamba/mamba_utils): a batch row that owns no state slot.
PAD_SLOT_ID = -1

_GDN_SCHEMAS = {
    "fused_sigmoid_mul_cpu": (_gdn.fused_sigmoid_mul, "(Tensor(a!) x, Tensor gate) -> ()"),
    "fused_qk_gemma_rmsnorm_cpu": (
        _gdn.fused_qk_gemma_rmsnorm,
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
    ),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        _gdn.fused_qk_gemma_rmsnorm_with_gate,
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_heads)"
        " -> (Tensor, Tensor, Tensor)",
    ),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        _gdn.fused_qkvzba_split_reshape_cat_contiguous,
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
    ),
    "fused_qkvzba_split_reshape_cat_cpu": (
        _gdn.fused_qkvzba_split_reshape_cat,
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
    ),
    "fused_rmsnorm_gated_cpu": (
        _gdn.fused_rmsnorm_gated, "(Tensor x, Tensor weight, Tensor z, float eps) -> Tensor"
    ),
    "fused_gdn_gating_cpu": (
        _gdn.fused_gdn_gating, "(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)"
    ),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        _gdn.fused_sigmoid_gating_delta_rule_update,
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b,"
        " Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens,"
        " bool use_qk_l2norm_in_kernel, float softplus_beta=1.0, float softplus_threshold=20.0) -> Tensor",
    ),
}
for _name, (_function, _schema) in _GDN_SCHEMAS.items():
    register_cpu_op(_name, _function, schema=_schema)


def _silu_requested(activation) -> bool:
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"conv activation {activation!r} is not supported: use None, 'silu' or 'swish'")
    return activation is not None


def _refuse_unsupported(op: str, **options) -> None:
    """The mamba wrappers serve the plain prefill / decode paths; spec-decoding and paged-conv extras are refused."""
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        raise NotImplementedError(
            f"sgl_kernel.mamba.{op} on relax's CPU platform does not support {given} (speculative decoding / "
            "paged conv state); run the engine without speculative decoding"
        )


def causal_conv1d_fn_cpu(x, weight, bias=None, activation=None, conv_states=None, has_initial_state=None,
                         cache_indices=None, query_start_loc=None, seq_lens_cpu=None, pad_slot_id=PAD_SLOT_ID,
                         block_table=None):
    """Prefill conv over packed sequences: x [conv_dim, total_tokens] -> [conv_dim, total_tokens]; each
    sequence's last W-1 inputs land in conv_states[cache_indices[i]]."""
    _refuse_unsupported("causal_conv1d_fn_cpu", block_table=block_table)
    return _gdn.causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                                  _silu_requested(activation), pad_slot_id, False)


def causal_conv1d_update_cpu(x, conv_state, weight, bias=None, activation=None, cache_seqlens=None,
                             conv_state_indices=None, pad_slot_id=PAD_SLOT_ID, intermediate_conv_window=None,
                             intermediate_state_indices=None, retrieve_next_token=None,
                             retrieve_next_sibling=None, retrieve_parent_token=None):
    """Decode conv step: x [N, conv_dim] -> [N, conv_dim]; conv_state updated in place at the rows' slots."""
    _refuse_unsupported("causal_conv1d_update_cpu", intermediate_conv_window=intermediate_conv_window,
                        intermediate_state_indices=intermediate_state_indices,
                        retrieve_next_token=retrieve_next_token, retrieve_next_sibling=retrieve_next_sibling,
                        retrieve_parent_token=retrieve_parent_token)
    return _gdn.causal_conv1d_update(x, conv_state, weight, bias, _silu_requested(activation), cache_seqlens,
                                     conv_state_indices, pad_slot_id, False)


def chunk_gated_delta_rule_cpu(q, k, v, g, beta, initial_state, cu_seqlens, head_first=False,
                               use_qk_l2norm_in_kernel=False, initial_state_indices=None):
    """Chunked prefill over packed sequences; states read from and written back to the pool
    initial_state[initial_state_indices] ([num_slots, Hv, V, K]). Returns (o [1, T, Hv, V], the pool, None):
    SGLang unpacks three values (output, final state, per-chunk states it only reads for state tracking)."""
    if initial_state_indices is None:
        raise ValueError("chunk_gated_delta_rule_cpu needs initial_state_indices (the pool slot of each sequence)")
    o, pool = _gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state, True, cu_seqlens, head_first,
                                          use_qk_l2norm_in_kernel, initial_state_indices)
    return o, pool, None


for _function in (causal_conv1d_fn_cpu, causal_conv1d_update_cpu, chunk_gated_delta_rule_cpu):
    register_cpu_op(_function.__name__, _function, submodule="mamba")


# The stand-in imports this module in every SGLang process: the place to adjust SGLang's non-AMX CPU paths too.
from relax.platform.cpu_sglang import install_non_amx_fallbacks  # noqa: E402

install_non_amx_fallbacks()
