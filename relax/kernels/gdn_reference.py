"""Gated DeltaNet (GDN) operators in plain torch: the readable, float32-accurate reference for every kernel.

Everything here is ordinary differentiable torch, so the chunked forward also serves training on CPU: its
backward is autograd through these ops (slow, exact; no hand-written backward).

Layouts (one choice each, conversions below):
- Token inputs follow flash-linear-attention: q, k [B, T, H, K]; v [B, T, Hv, V]; g, beta [B, T, Hv]. With
  Hv > H (grouped value heads) v-head h reads q/k head h // (Hv // H), as HF's repeat_interleave does.
- Recurrent state of one sequence, as HF and fla hand it in and out of the chunked forward: [Hv, K, V].
- Recurrent state *pool* for decode, indexed by slot: [num_slots, Hv, V, K], SGLang's layout (each value row
  contiguous over K). `state_to_pool_layout` / `state_from_pool_layout` convert.
- Conv state pool: [num_slots, conv_dim, W-1] holding the last W-1 inputs, oldest first (SGLang's layout).
  HF's cache keeps W columns whose first is never read: pool = hf[..., 1:], see `conv_state_from_hf`.
- Mixed qkv channel order, as conv1d sees it: [q (H*K) | k (H*K) | v (Hv*V)].
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # fla's and HF's default


# ----------------------------------------------------------------------------------------------------------
# Layout conversions
# ----------------------------------------------------------------------------------------------------------
def state_to_pool_layout(state: torch.Tensor) -> torch.Tensor:
    """[..., K, V] (HF / fla) -> [..., V, K] (the decode pool's layout), contiguous."""
    return state.transpose(-1, -2).contiguous()


def state_from_pool_layout(state: torch.Tensor) -> torch.Tensor:
    """[..., V, K] (the decode pool's layout) -> [..., K, V] (HF / fla), contiguous."""
    return state.transpose(-1, -2).contiguous()


def conv_state_from_hf(hf_conv_state: torch.Tensor) -> torch.Tensor:
    """HF's conv cache [B, conv_dim, W] -> pool layout [B, conv_dim, W-1] (HF's first column is never read)."""
    return hf_conv_state[..., 1:].contiguous()


def conv_state_to_hf(conv_state: torch.Tensor) -> torch.Tensor:
    """Pool layout [B, conv_dim, W-1] -> HF's conv cache [B, conv_dim, W] (unread first column zero)."""
    return F.pad(conv_state, (1, 0))


# ----------------------------------------------------------------------------------------------------------
# Small elementwise / norm ops
# ----------------------------------------------------------------------------------------------------------
def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS, output_dtype: torch.dtype | None = None, dim: int = -1):
    """x / sqrt(sum(x^2) + eps) over `dim`, computed in float32 (fla.modules.l2norm.l2norm's signature)."""
    x32 = x.float()
    y = x32 * torch.rsqrt((x32 * x32).sum(dim=dim, keepdim=True) + eps)
    return y.to(output_dtype or x.dtype)


def gdn_gating(
    A_log: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    dt_bias: torch.Tensor,
    softplus_beta: float = 1.0,
    softplus_threshold: float = 20.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias) (log-space decay, <= 0) and beta = sigmoid(b), both float32.

    a, b: [..., Hv]; A_log, dt_bias: [Hv]. softplus switches to identity above the threshold, as torch's does.
    """
    x = a.float() + dt_bias.float()
    g = -A_log.float().exp() * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    return g, b.float().sigmoid()


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate) in float32, cast to x's dtype (attention output gate of Qwen3.5's full-attention layers)."""
    return (x.float() * gate.float().sigmoid()).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(z) over the last dim, exactly as HF's Qwen3NextRMSNormGated (norm before gate)."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(x.dtype)
    return (out * F.silu(z.float())).to(x.dtype)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with a zero-centred weight: x / rms(x) * (1 + weight), in float32, cast to x's dtype."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * (1.0 + weight.float())).to(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# QKVZBA split
# ----------------------------------------------------------------------------------------------------------
QKVZ_LAYOUTS = ("interleaved", "contiguous")


def split_qkvzba(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    layout: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the input projections into (mixed_qkv [..., 2*H*K + Hv*V], z [..., Hv, V], b [..., Hv], a [..., Hv]).

    layout="interleaved": Qwen3-Next's in_proj_qkvz / in_proj_ba, grouped per key head:
        qkvz = [per k-head: q (K) | k (K) | v (r*V) | z (r*V)], ba = [per k-head: b (r) | a (r)], r = Hv // H.
    layout="contiguous": Qwen3.5's separate in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, concatenated (SGLang's
        merged projection, or Megatron's in_proj without its b/a tail):
        qkvz = [q (H*K) | k (H*K) | v (Hv*V) | z (Hv*V)], ba = [b (Hv) | a (Hv)].
    """
    if layout not in QKVZ_LAYOUTS:
        raise ValueError(f"layout={layout!r}: use one of {QKVZ_LAYOUTS}")
    if num_v_heads % num_k_heads:
        raise ValueError(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
    r = num_v_heads // num_k_heads
    qkvz_dim = 2 * num_k_heads * head_k_dim + 2 * num_v_heads * head_v_dim
    if mixed_qkvz.shape[-1] != qkvz_dim or mixed_ba.shape[-1] != 2 * num_v_heads:
        raise ValueError(
            f"mixed_qkvz last dim {mixed_qkvz.shape[-1]} (expected {qkvz_dim}) / mixed_ba last dim "
            f"{mixed_ba.shape[-1]} (expected {2 * num_v_heads}) do not match the head counts and dims given"
        )
    lead = mixed_qkvz.shape[:-1]
    if layout == "interleaved":
        grouped = mixed_qkvz.reshape(*lead, num_k_heads, -1)
        q, k, v, z = grouped.split([head_k_dim, head_k_dim, r * head_v_dim, r * head_v_dim], dim=-1)
        b, a = mixed_ba.reshape(*lead, num_k_heads, 2 * r).split([r, r], dim=-1)
        q, k, v, z = (t.reshape(*lead, -1) for t in (q, k, v, z))
        b, a = b.reshape(*lead, num_v_heads), a.reshape(*lead, num_v_heads)
    else:
        key_dim, value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        q, k, v, z = mixed_qkvz.split([key_dim, key_dim, value_dim, value_dim], dim=-1)
        b, a = mixed_ba.split([num_v_heads, num_v_heads], dim=-1)
    mixed_qkv = torch.cat([q, k, v], dim=-1)
    return mixed_qkv, z.reshape(*lead, num_v_heads, head_v_dim).contiguous(), b.contiguous(), a.contiguous()


# ----------------------------------------------------------------------------------------------------------
# Causal depthwise conv1d
# ----------------------------------------------------------------------------------------------------------
def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"activation={activation!r}: use None, 'silu' or 'swish'")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    activation: str | None = None,
):
    """Depthwise causal conv over a full sequence (causal_conv1d.causal_conv1d_fn's signature and semantics).

    x: [B, D, T]; weight: [D, W]; bias: [D]; initial_states: [B, D, W-1], the W-1 inputs before x (zeros if None).
    Returns y [B, D, T] in x's dtype, and with return_final_states also the last W-1 inputs [B, D, W-1].
    """
    width = weight.shape[-1]
    if initial_states is None:
        initial_states = x.new_zeros(x.shape[0], x.shape[1], width - 1)
    padded = torch.cat([initial_states.to(x.dtype), x], dim=-1)
    y = F.conv1d(padded.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                 groups=x.shape[1])
    y = _activate(y, activation).to(x.dtype)
    if return_final_states:
        return y, padded[..., padded.shape[-1] - (width - 1):].contiguous()
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state_pool: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    slot_indices: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the causal conv for N rows, each with its state in a slot of the pool.

    x: [N, D] (the new input of each row); conv_state_pool: [num_slots, D, W-1], updated in place for the rows'
    slots; slot_indices: [N]. A row whose slot is negative (SGLang's padding) is skipped: zero output, no state
    touched. Returns y [N, D] in x's dtype.
    """
    y = torch.zeros_like(x)
    live = (slot_indices >= 0).nonzero().flatten()
    slots = slot_indices[live].long()
    window = torch.cat([conv_state_pool[slots].to(x.dtype), x[live].unsqueeze(-1)], dim=-1)  # [n, D, W]
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    y[live] = _activate(out, activation).to(x.dtype)
    conv_state_pool[slots] = window[..., 1:].to(conv_state_pool.dtype)
    return y


# ----------------------------------------------------------------------------------------------------------
# Gated delta rule
# ----------------------------------------------------------------------------------------------------------
def _prepare_heads(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    """float32, heads first ([H, T, D] / [H, T]), q/k repeated to the value heads, q scaled."""
    num_k_heads, num_v_heads = q.shape[-2], v.shape[-2]
    if num_v_heads % num_k_heads:
        raise ValueError(f"value heads ({num_v_heads}) must be a multiple of query/key heads ({num_k_heads})")
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    repeat = num_v_heads // num_k_heads
    return q.repeat_interleave(repeat, 0), k.repeat_interleave(repeat, 0), v, g, beta


def _sequences(q, cu_seqlens):
    """(batch index, token slice) of each sequence, checking the varlen contract of fla."""
    if cu_seqlens is None:
        return [(i, slice(None)) for i in range(q.shape[0])], q.shape[0]
    if q.shape[0] != 1:
        raise ValueError(f"with cu_seqlens the batch dim must be 1 (sequences packed along T), got {q.shape[0]}")
    bounds = cu_seqlens.tolist()
    return [(0, slice(s, e)) for s, e in zip(bounds[:-1], bounds[1:])], len(bounds) - 1


def _run_per_sequence(step_fn, q, k, v, g, beta, scale, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel, cu_seqlens):
    """Run `step_fn` over every sequence. Sequences of one length run in one call with their heads stacked
    (heads never interact), so a batch of equal-length rollouts costs one call, not one per sequence."""
    seqs, num_seqs = _sequences(q, cu_seqlens)
    if initial_state is not None and initial_state.shape[0] != num_seqs:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for {num_seqs} sequences")
    num_v_heads, head_k_dim, head_v_dim = v.shape[-2], q.shape[-1], v.shape[-1]
    by_length: dict[int, list[int]] = {}
    for n, (_, tokens) in enumerate(seqs):
        by_length.setdefault(len(range(q.shape[1])[tokens]), []).append(n)
    outputs, finals = [None] * num_seqs, [None] * num_seqs
    for members in by_length.values():
        prepared = [_prepare_heads(q[b, tokens], k[b, tokens], v[b, tokens], g[b, tokens], beta[b, tokens], scale,
                                   use_qk_l2norm_in_kernel) for b, tokens in (seqs[n] for n in members)]
        qh, kh, vh, gh, bh = (torch.cat(parts) for parts in zip(*prepared))
        if initial_state is None:
            state = q.new_zeros(len(members) * num_v_heads, head_k_dim, head_v_dim, dtype=torch.float32)
        else:
            state = initial_state[members].float().flatten(0, 1)
        o, state = step_fn(qh, kh, vh, gh, bh, state)
        for n, o_n, state_n in zip(members, o.split(num_v_heads), state.split(num_v_heads)):
            outputs[n], finals[n] = o_n.transpose(0, 1), state_n
    if cu_seqlens is None:
        o = torch.stack(outputs)
    else:
        o = torch.cat(outputs).unsqueeze(0)
    return o.to(v.dtype), (torch.stack(finals) if output_final_state else None)


def _recurrent_steps(q, k, v, g, beta, state):
    """Token by token: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q. Shapes [H, T, *], state [H, K, V]."""
    outputs = []
    for t in range(q.shape[1]):
        state = state * g[:, t, None, None].exp()
        predicted = torch.einsum("hkv,hk->hv", state, k[:, t])
        delta = beta[:, t, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, None] * delta[:, None, :]
        outputs.append(torch.einsum("hkv,hk->hv", state, q[:, t]))
    return torch.stack(outputs, dim=1), state


def recurrent_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The gated delta rule one token at a time: the definition the chunked form must reproduce.

    Same arguments and results as `chunk_gated_delta_rule` (fla's fused_recurrent_gated_delta_rule contract).
    """
    return _run_per_sequence(_recurrent_steps, q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens)


@dataclass
class ChunkTerms:
    """What the chunked rule computes inside each chunk before any state is known (`chunk_terms`). Shapes [..., C, *]
    for chunks of C tokens: per chunk with incoming state S0 the new values are u = u_values - u_state S0, the output
    o = q_decayed S0 + attn u, and the outgoing state decay_total S0 + k_to_end^T u."""

    u_values: torch.Tensor  # [..., C, V]
    u_state: torch.Tensor  # [..., C, K]
    q_decayed: torch.Tensor  # [..., C, K]
    attn: torch.Tensor  # [..., C, C]
    k_to_end: torch.Tensor  # [..., C, K]
    decay_total: torch.Tensor  # [...]


def chunk_terms(q, k, v, g, beta) -> ChunkTerms:
    """The state-free terms of the chunked (WY / UT-transform) rule over chunks [..., C, *] (any leading dims).

    Inside a chunk with incoming state S0 and cumulative log decay c_t (through t):
      u = U - W S0 with A U = beta v, A W = beta e^c k, A = I + strictly_lower(beta_t e^(c_t - c_s) k_t.k_s)
      o_t = e^(c_t) q_t S0 + sum_{s<=t} e^(c_t - c_s) (q_t.k_s) u_s
      S_end = e^(c_last) S0 + sum_s e^(c_last - c_s) k_s u_s^T
    Padding tokens carry beta = 0 and g = 0 (and zero q, k, v), so they change nothing.
    """
    chunk_size = q.shape[-2]
    cum = g.cumsum(-1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # segment[t, s] = c_t - c_s (s <= t) summed over g_(s+1..t) itself, down the rows of g_i kept below the diagonal:
    # the difference of two cumulative sums is off by ulps of c, which with per-token gates of -1e3 (chunk sums of
    # -1e5, fp32) made decays off by percents and gate gradients off by up to 4x (test_gdn_reference_gradients.py).
    segment = g[..., :, None].expand(*g.shape, chunk_size).masked_fill(~causal.tril(-1), 0.0).cumsum(-2)
    decay = segment.masked_fill(~causal, float("-inf")).exp()  # masked: no overflow from the upper triangle
    system = torch.eye(chunk_size, device=q.device) + (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)
    # One solve for both right-hand sides: A U = beta v and A W = beta e^c k.
    u_values, u_state = torch.linalg.solve_triangular(
        system, torch.cat([beta[..., None] * v, (beta * cum.exp())[..., None] * k], dim=-1), upper=False,
        unitriangular=True).split([v.shape[-1], k.shape[-1]], dim=-1)
    return ChunkTerms(
        u_values=u_values, u_state=u_state, q_decayed=q * cum.exp()[..., None],
        attn=(q @ k.transpose(-1, -2)) * decay, k_to_end=k * decay[..., -1, :, None],  # e^(c_last - c_s)
        decay_total=cum[..., -1].exp(),
    )


def _chunked_steps(q, k, v, g, beta, state, chunk_size):
    """Chunked evaluation of `_recurrent_steps` (`chunk_terms`, then the chunks in order), exact up to float
    rounding."""
    num_heads, length = q.shape[0], q.shape[1]
    chunk_size = max(1, min(chunk_size, length))  # a short sequence is one chunk of its own length, not padded
    pad = (-length) % chunk_size
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    num_chunks = q.shape[1] // chunk_size
    q, k, v = (t.reshape(num_heads, num_chunks, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(num_heads, num_chunks, chunk_size) for t in (g, beta))
    terms = chunk_terms(q, k, v, g, beta)

    outputs = []
    for c in range(num_chunks):
        u = terms.u_values[:, c] - terms.u_state[:, c] @ state
        outputs.append(terms.q_decayed[:, c] @ state + terms.attn[:, c] @ u)
        state = state * terms.decay_total[:, c, None, None] + terms.k_to_end[:, c].transpose(-1, -2) @ u
    o = torch.cat(outputs, dim=1)[:, :length]
    return o, state


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64, **unused):
    """Chunked gated delta rule with fla's `chunk_gated_delta_rule` signature (what Megatron's GatedDeltaNet calls).

    q, k: [B, T, H, K]; v: [B, T, Hv, V]; g (log decay, <= 0), beta: [B, T, Hv]; scale defaults to K^-0.5;
    initial_state: [N, Hv, K, V]; cu_seqlens: [N+1] with B == 1 for packed variable-length sequences.
    Returns (o [B, T, Hv, V] in v's dtype, final state [N, Hv, K, V] float32 or None). Differentiable.
    Extra keyword arguments fla accepts (head_first, ...) are not supported: passing one raises.
    """
    if unused:
        raise TypeError(f"chunk_gated_delta_rule: unsupported arguments {sorted(unused)}")

    def steps(qh, kh, vh, gh, bh, state):
        return _chunked_steps(qh, kh, vh, gh, bh, state, chunk_size)

    return _run_per_sequence(steps, q, k, v, g, beta, scale, initial_state, output_final_state,
                             use_qk_l2norm_in_kernel, cu_seqlens)


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slot_indices: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm_in_kernel: bool = True,
) -> torch.Tensor:
    """One decode token per row over the slot-indexed state pool [num_slots, Hv, V, K], updated in place.

    q, k: [N, H, K]; v: [N, Hv, V]; g, beta: [N, Hv]. Rows with a negative slot are skipped (zero output).
    Returns o [N, Hv, V] in v's dtype.
    """
    o = torch.zeros_like(v)
    live = (slot_indices >= 0).nonzero().flatten()
    slots = slot_indices[live].long()
    initial = state_from_pool_layout(state_pool[slots].float())
    out, final = recurrent_gated_delta_rule(
        q[live, None], k[live, None], v[live, None], g[live, None], beta[live, None], scale=scale,
        initial_state=initial, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    o[live] = out[:, 0]
    state_pool[slots] = state_to_pool_layout(final).to(state_pool.dtype)
    return o


def gdn_decode(
    mixed_qkvz: torch.Tensor,
    mixed_ba: torch.Tensor,
    conv_state_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    state_pool: torch.Tensor,
    slot_indices: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    layout: str,
) -> torch.Tensor:
    """A whole GDN decode step, from the input projections to the gated-norm output (before out_proj).

    The composition the fused Triton kernel implements: QKVZBA split, conv1d state update (silu), q/k l2norm,
    gating, the delta-rule update of the pooled state, gated RMSNorm. mixed_qkvz [N, 2*H*K + 2*Hv*V],
    mixed_ba [N, 2*Hv]; both pools updated in place. Returns [N, Hv, V] in mixed_qkvz's dtype.
    """
    num_v_heads = A_log.shape[0]
    mixed_qkv, z, b, a = split_qkvzba(mixed_qkvz, mixed_ba, num_k_heads, num_v_heads, head_k_dim, head_v_dim,
                                      layout)
    mixed_qkv = causal_conv1d_update(mixed_qkv, conv_state_pool, conv_weight, conv_bias, "silu", slot_indices)
    key_dim = num_k_heads * head_k_dim
    q, k, v = mixed_qkv.split([key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    n = mixed_qkv.shape[0]
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    o = gated_delta_rule_decode(q.reshape(n, num_k_heads, head_k_dim), k.reshape(n, num_k_heads, head_k_dim),
                                v.reshape(n, num_v_heads, head_v_dim), g, beta, state_pool, slot_indices)
    return gated_rms_norm(o, z, norm_weight, norm_eps)  # skipped rows stay zero: their o is zero
