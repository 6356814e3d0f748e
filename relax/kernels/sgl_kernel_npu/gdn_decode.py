"""The gated delta rule's recurrent update with the sigmoid gating fused in, over a slot-indexed state pool: what
SGLang's Ascend GDN backend calls for a decode batch (`fused_sigmoid_gating_delta_rule_update_decode_npu`, the
name SGLang v0.5.23 imports). Reference: relax.kernels.gdn_sglang_ops.fused_sigmoid_gating_delta_rule_update.

`gdn_log_decay` and `delta_rule_tile` are the two steps relax's GDN kernels (relax.kernels.gdn_triton: the
fused decode step and the gating) share with this one.
"""

import torch
import triton
import triton.language as tl

from .launch import grid_size

MAX_BLOCK_V = 32  # state rows per tile: a [32, K <= 128] float32 tile, its two products and the update stay near
                  # 64 KB of a vector core's 192 KB unified buffer


@triton.jit
def gdn_log_decay(a, A_log, dt_bias, softplus_beta, softplus_threshold):
    """g = -exp(A_log) * softplus(a + dt_bias), the log of a value head's decay, from float32 inputs;
    softplus(x) = log(1 + exp(softplus_beta * x)) / softplus_beta, x itself above the threshold (torch's)."""
    x = a + dt_bias
    scaled = softplus_beta * x
    softplus = tl.where(scaled <= softplus_threshold, tl.log(1.0 + tl.exp(scaled)) / softplus_beta, x)
    return -tl.exp(A_log) * softplus


@triton.jit
def delta_rule_tile(s, k, q, v_tile, decay, beta, kq):
    """One token's update of a state tile s [BV, K] (value rows x key dims, the pool's layout) and its output rows:
    S' = decay S + beta (v - decay S k) k^T, o = S' q, both products taken from the old S:
    o = decay S q + beta (v - decay S k) (k . q). Returns (S', o) in float32."""
    sk = tl.sum(s * k[None, :], axis=1)
    sq = tl.sum(s * q[None, :], axis=1)
    delta = (v_tile - decay * sk) * beta
    return s * decay + delta[:, None] * k[None, :], decay * sq + delta * kq


@triton.jit
def _gated_delta_rule_decode_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, A_log_ptr, dt_bias_ptr, state_ptr, slot_ptr, cu_seqlens_ptr, out_ptr,
    num_seqs, tokens_per_seq, q_token_stride, k_token_stride, v_token_stride, a_token_stride, b_token_stride,
    state_slot_stride, scale, softplus_beta, softplus_threshold,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    L2NORM: tl.constexpr, VARLEN: tl.constexpr,
):
    """One work item = one sequence x one value head x one tile of BV state rows; the tile stays on chip through
    the sequence's tokens. A sequence whose slot is negative (padding) leaves the pool alone and outputs zeros."""
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    rows_in_tile = tl.arange(0, BV)
    num_tiles: tl.constexpr = (V + BV - 1) // BV
    for item in range(tl.program_id(0), num_seqs * HV * num_tiles, tl.num_programs(0)):
        seq = item // (HV * num_tiles)
        hv = (item // num_tiles) % HV
        offs_v = (item % num_tiles) * BV + rows_in_tile
        mask_v = offs_v < V
        if VARLEN:
            bos = tl.load(cu_seqlens_ptr + seq).to(tl.int32)
            eos = tl.load(cu_seqlens_ptr + seq + 1).to(tl.int32)
        else:
            bos = seq * tokens_per_seq
            eos = bos + tokens_per_seq
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        out_rows = out_ptr + hv * V + offs_v
        if slot < 0:
            for t in range(bos, eos):
                tl.store(out_rows + t * HV * V, tl.zeros([BV], dtype=out_ptr.dtype.element_ty), mask=mask_v)
        else:
            tile = state_ptr + slot * state_slot_stride + hv * V * K + offs_v[:, None] * K + offs_k[None, :]
            tile_mask = mask_v[:, None] & mask_k[None, :]
            s = tl.load(tile, mask=tile_mask, other=0.0).to(tl.float32)
            h = hv // (HV // H)  # the q/k head of this value head
            A_log = tl.load(A_log_ptr + hv).to(tl.float32)
            dt_bias = tl.load(dt_bias_ptr + hv).to(tl.float32)
            for t in range(bos, eos):
                q = tl.load(q_ptr + t * q_token_stride + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                k = tl.load(k_ptr + t * k_token_stride + h * K + offs_k, mask=mask_k, other=0.0).to(tl.float32)
                if L2NORM:
                    q = q * tl.rsqrt(tl.sum(q * q) + 1e-6)
                    k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
                q = q * scale
                decay = tl.exp(gdn_log_decay(tl.load(a_ptr + t * a_token_stride + hv).to(tl.float32), A_log,
                                             dt_bias, softplus_beta, softplus_threshold))
                beta = tl.sigmoid(tl.load(b_ptr + t * b_token_stride + hv).to(tl.float32))
                v_tile = tl.load(v_ptr + t * v_token_stride + hv * V + offs_v, mask=mask_v, other=0.0).to(tl.float32)
                s, o = delta_rule_tile(s, k, q, v_tile, decay, beta, tl.sum(k * q))
                tl.store(out_rows + t * HV * V, o.to(out_ptr.dtype.element_ty), mask=mask_v)
            tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=tile_mask)


def _tokens(x: torch.Tensor, *inner: int) -> torch.Tensor:
    """x [B, T, *inner] (or [B*T, *inner]) as [tokens, *inner], each token's block contiguous (SGLang's q/k/v are
    strided views of one projection: their tokens stay strided, no copy)."""
    flat = x.reshape(-1, *inner)
    return flat if flat.shape[0] == 0 or flat[0].is_contiguous() else flat.contiguous()


def fused_sigmoid_gating_delta_rule_update_decode_npu(
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float,
    softplus_threshold: float,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    b: torch.Tensor,
    initial_state_source: torch.Tensor,
    initial_state_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    is_kda: bool = False,
    disable_state_update: bool = False,
    intermediate_states_buffer: torch.Tensor | None = None,
    intermediate_state_indices: torch.Tensor | None = None,
    cache_steps: int | None = None,
    retrieve_parent_token: torch.Tensor | None = None,
    num_programs: int | None = None,
    block_v: int = MAX_BLOCK_V,
) -> torch.Tensor:
    """Gating (decay = exp(-exp(A_log) * softplus(a + dt_bias)), beta = sigmoid(b)) and the delta rule, token by
    token, on the states initial_state_source[initial_state_indices] ([num_slots, HV, V, K]), updated in place.

    q, k [B, T, H, K]; v [B, T, HV, V]; a, b [B*T, HV] (or [B, T, HV]). Sequences: with cu_seqlens [N+1] (B = 1)
    the packed spans, else the B rows of T tokens; initial_state_indices [N], a negative index marks padding (zero
    output, no state touched). Returns o of v's shape. The keywords of SGLang's speculative target-verify call
    (intermediate states, disabled state update) and KDA gating are refused: this kernel serves decode batches.
    num_programs: the grid's bound (default: the NPU's vector cores); block_v: state rows per tile (power of two).
    """
    if is_kda or disable_state_update or intermediate_states_buffer is not None or cache_steps is not None:
        raise NotImplementedError("relax's fused GDN decode kernel serves plain decode batches: KDA gating and "
                                  "speculative target verification (intermediate states, no state update) are not "
                                  "implemented; run without speculative decoding")
    batch, tokens_per_seq, num_heads, head_k_dim = k.shape
    num_v_heads, head_v_dim = v.shape[-2:]
    if q.shape != k.shape or v.shape[:2] != (batch, tokens_per_seq) or num_v_heads % num_heads:
        raise ValueError(f"q, k must be [B, T, H, K] and v [B, T, HV, V] with HV a multiple of H, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if initial_state_source.shape[1:] != (num_v_heads, head_v_dim, head_k_dim) or \
            not initial_state_source[0].is_contiguous():
        raise ValueError(f"initial_state_source must be [num_slots, {num_v_heads}, {head_v_dim}, {head_k_dim}] "
                         f"with contiguous slots, got {tuple(initial_state_source.shape)}")
    if cu_seqlens is not None and batch != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed along T: B must be 1, got {batch}")
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state_indices.shape != (num_seqs,):
        raise ValueError(f"initial_state_indices must be [{num_seqs}] (one slot per sequence), got "
                         f"{tuple(initial_state_indices.shape)}")
    if block_v < 1 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two")
    q_tokens, k_tokens = _tokens(q, num_heads, head_k_dim), _tokens(k, num_heads, head_k_dim)
    v_tokens = _tokens(v, num_v_heads, head_v_dim)
    a_tokens, b_tokens = _tokens(a, num_v_heads), _tokens(b, num_v_heads)
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    items = num_seqs * num_v_heads * triton.cdiv(head_v_dim, block_v)
    if items:
        _gated_delta_rule_decode_kernel[(grid_size(items, v.device, num_programs),)](
            q_tokens, k_tokens, v_tokens, a_tokens, b_tokens, A_log, dt_bias, initial_state_source,
            initial_state_indices, cu_seqlens, out,
            num_seqs, tokens_per_seq, q_tokens.stride(0), k_tokens.stride(0), v_tokens.stride(0),
            a_tokens.stride(0), b_tokens.stride(0), initial_state_source.stride(0),
            head_k_dim ** -0.5 if scale is None else scale, softplus_beta, softplus_threshold,
            H=num_heads, HV=num_v_heads, K=head_k_dim, V=head_v_dim, BK=triton.next_power_of_2(head_k_dim),
            BV=block_v, L2NORM=use_qk_l2norm_in_kernel, VARLEN=cu_seqlens is not None,
        )
    return out
