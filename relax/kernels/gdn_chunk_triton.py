"""relax's chunked gated delta rule for training ("relax" in relax.kernels.gdn_training): every sequence of a packed
batch at once, the state passed from chunk to chunk by two Triton kernels, the rest batched torch.

The rule is relax.kernels.gdn_reference's chunked form. Each sequence is cut into chunks of CHUNK tokens (its last
chunk padded with tokens that change nothing), and the chunks of all sequences are laid side by side, [chunks,
heads, CHUNK, *]. What needs no state (relax.kernels.gdn_reference.chunk_terms) is a batch of small matrix products
and one triangular solve over all chunks; the gradients of that part are autograd's. Only the state pass is
sequential, per sequence:

    u_c = u_values_c - u_state_c S_c              (the chunk's new values)
    S_(c+1) = decay_total_c S_c + k_to_end_c^T u_c
    o_c = q_decayed_c S_c + attn_c u_c

`_state_pass_forward` runs it for one (sequence, head, tile of launch.chunk_state_block_v value columns) per work
item and writes every chunk's incoming state S_c and new values u_c; the outputs and the gradients that sum over the
value columns are batched products of those. `_state_pass_backward` runs the same chain backwards for the gradients
of the states and the new values. The rule keeps only its inputs for the backward, which computes the chunk terms
and the state pass again: the float32 terms and the states, [chunks, heads, K, V], live only while one layer
computes.

Written to the porting rules of relax.kernels.gdn_triton: a 1-D grid of at most `launch.num_programs` programs, each
looping over work items with a stride of the grid size; launch keywords only from `launch.options`.
"""

import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint

from relax.kernels import gdn_reference
from relax.kernels.launch import TritonLaunch

CHUNK = 64  # tokens per chunk: fla's and MindSpeed's chunk size
# float32 products, as the reference's. On an H100 with Triton 3.6.0, "tf32x3" at 4 warps (50.5 ms a layer) was no
# faster than this at 8 (45.8 ms), and at 8 warps it failed with an illegal memory access.
PRECISION = "ieee"


@triton.jit
def _work_item(item, heads, K, V, BK: tl.constexpr, BV: tl.constexpr):
    """Work item `item`'s sequence and head, its value columns, the offsets of its state tile within one [K, V] state
    and where the sequence's [heads, K, V] state of its head starts."""
    tiles = tl.cdiv(V, BV)
    cols = (item % tiles) * BV + tl.arange(0, BV)
    head = (item // tiles) % heads
    seq = item // (tiles * heads)
    offs_k = tl.arange(0, BK)
    mask_state = (offs_k < K)[:, None] & (cols < V)[None, :]
    seq_state = (tl.cast(seq, tl.int64) * heads + head) * K * V
    return seq, head, cols, offs_k[:, None] * V + cols[None, :], mask_state, seq_state


@triton.jit
def _chunk_tiles(chunk, head, heads, cols, K, V, CHUNK: tl.constexpr, BK: tl.constexpr):
    """Offsets of a chunk's [CHUNK, value columns] and [CHUNK, K] tiles for `head`, and where its state starts."""
    chunk_head = tl.cast(chunk, tl.int64) * heads + head
    rows = tl.arange(0, CHUNK)[:, None]
    value_offs = chunk_head * CHUNK * V + rows * V + cols[None, :]
    key_offs = chunk_head * CHUNK * K + rows * K + tl.arange(0, BK)[None, :]
    return value_offs, key_offs, chunk_head * K * V, chunk_head


@triton.jit
def _state_pass_forward(u_values_ptr, u_state_ptr, k_to_end_ptr, decay_total_ptr, initial_ptr, states_ptr, u_ptr,
                        final_ptr, chunk_bounds_ptr, num_seqs, heads, K, V, HAS_INITIAL: tl.constexpr,
                        CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PRECISION: tl.constexpr):
    """For each chunk c of a sequence: states[c] = S_c, u[c] = u_values_c - u_state_c S_c; final = the state after the
    sequence's last chunk. Chunk-major layouts: [chunks, heads, CHUNK, K or V], states [chunks, heads, K, V]."""
    mask_k = (tl.arange(0, BK) < K)[None, :]
    for item in range(tl.program_id(0), num_seqs * heads * tl.cdiv(V, BV), tl.num_programs(0)):
        seq, head, cols, state_offs, mask_state, seq_state = _work_item(item, heads, K, V, BK, BV)
        mask_v = (cols < V)[None, :]
        state = tl.zeros((BK, BV), tl.float32)
        if HAS_INITIAL:
            state += tl.load(initial_ptr + seq_state + state_offs, mask=mask_state, other=0.0)
        for c in range(tl.load(chunk_bounds_ptr + seq), tl.load(chunk_bounds_ptr + seq + 1)):
            value_offs, key_offs, chunk_state, chunk_head = _chunk_tiles(c, head, heads, cols, K, V, CHUNK, BK)
            tl.store(states_ptr + chunk_state + state_offs, state, mask=mask_state)
            u_state = tl.load(u_state_ptr + key_offs, mask=mask_k, other=0.0)
            u = tl.load(u_values_ptr + value_offs, mask=mask_v, other=0.0)
            u -= tl.dot(u_state, state, input_precision=PRECISION)
            tl.store(u_ptr + value_offs, u, mask=mask_v)
            k_to_end = tl.load(k_to_end_ptr + key_offs, mask=mask_k, other=0.0)
            state = state * tl.load(decay_total_ptr + chunk_head) + tl.dot(tl.trans(k_to_end), u,
                                                                            input_precision=PRECISION)
        tl.store(final_ptr + seq_state + state_offs, state, mask=mask_state)


@triton.jit
def _state_pass_backward(u_grad_ptr, states_grad_ptr, u_state_ptr, k_to_end_ptr, decay_total_ptr, final_grad_ptr,
                         u_total_grad_ptr, next_state_grad_ptr, initial_grad_ptr, chunk_bounds_ptr, num_seqs, heads, K,
                         V, HAS_FINAL_GRAD: tl.constexpr, CHUNK: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                         PRECISION: tl.constexpr):
    """The state pass backwards, from the gradients the outputs give the states (states_grad) and the new values
    (u_grad), and the final state's gradient: per chunk, from the last, G = the gradient of S_(c+1) (written to
    next_state_grad[c]); the new values' whole gradient u_grad_c + k_to_end_c G (written to u_total_grad[c]);
    then S_c's: states_grad_c + decay_total_c G - u_state_c^T (u's whole gradient). initial_grad = S_0's."""
    mask_k = (tl.arange(0, BK) < K)[None, :]
    for item in range(tl.program_id(0), num_seqs * heads * tl.cdiv(V, BV), tl.num_programs(0)):
        seq, head, cols, state_offs, mask_state, seq_state = _work_item(item, heads, K, V, BK, BV)
        mask_v = (cols < V)[None, :]
        grad = tl.zeros((BK, BV), tl.float32)
        if HAS_FINAL_GRAD:
            grad += tl.load(final_grad_ptr + seq_state + state_offs, mask=mask_state, other=0.0)
        first, end = tl.load(chunk_bounds_ptr + seq), tl.load(chunk_bounds_ptr + seq + 1)
        for back in range(0, end - first):
            value_offs, key_offs, chunk_state, chunk_head = _chunk_tiles(end - 1 - back, head, heads, cols, K, V,
                                                                         CHUNK, BK)
            tl.store(next_state_grad_ptr + chunk_state + state_offs, grad, mask=mask_state)
            k_to_end = tl.load(k_to_end_ptr + key_offs, mask=mask_k, other=0.0)
            u_grad = tl.load(u_grad_ptr + value_offs, mask=mask_v, other=0.0)
            u_grad += tl.dot(k_to_end, grad, input_precision=PRECISION)
            tl.store(u_total_grad_ptr + value_offs, u_grad, mask=mask_v)
            u_state = tl.load(u_state_ptr + key_offs, mask=mask_k, other=0.0)
            states_grad = tl.load(states_grad_ptr + chunk_state + state_offs, mask=mask_state, other=0.0)
            grad = (states_grad + grad * tl.load(decay_total_ptr + chunk_head)
                    - tl.dot(tl.trans(u_state), u_grad, input_precision=PRECISION))
        tl.store(initial_grad_ptr + seq_state + state_offs, grad, mask=mask_state)


def _launch_state_pass(kernel, launch: TritonLaunch, num_seqs: int, heads: int, K: int, V: int, *args, **flags):
    block_v, options = launch.chunk_state_block_v, {**launch.options, **launch.chunk_state_options}
    items = num_seqs * heads * triton.cdiv(V, block_v)
    grid = (max(1, min(items, launch.num_programs)),)
    kernel[grid](*args, num_seqs, heads, K, V, **flags, CHUNK=CHUNK, BK=max(16, triton.next_power_of_2(K)),
                 BV=block_v, PRECISION=PRECISION, **options)


def _states_forward(terms, initial, chunk_bounds, launch):
    """(states [chunks, heads, K, V], u [chunks, heads, CHUNK, V], final [seqs, heads, K, V]) of the state pass."""
    u_values, u_state, k_to_end, decay_total = terms
    chunks, heads, _, V = u_values.shape
    K = u_state.shape[-1]
    num_seqs = chunk_bounds.numel() - 1
    states = u_values.new_empty(chunks, heads, K, V)
    u = torch.empty_like(u_values)
    final = u_values.new_empty(num_seqs, heads, K, V)
    _launch_state_pass(_state_pass_forward, launch, num_seqs, heads, K, V, u_values, u_state, k_to_end, decay_total,
                       initial, states, u, final, chunk_bounds, HAS_INITIAL=initial is not None)
    return states, u, final


class _StatePass(torch.autograd.Function):
    """(o [chunks, heads, CHUNK, V], final state [seqs, heads, K, V]) of the chunk terms and the initial states."""

    @staticmethod
    def forward(ctx, u_values, u_state, k_to_end, decay_total, q_decayed, attn, initial, chunk_bounds, launch):
        states, u, final = _states_forward((u_values, u_state, k_to_end, decay_total), initial, chunk_bounds, launch)
        # Kept only while the layer's backward runs: chunk_gated_delta_rule computes this function again there
        ctx.save_for_backward(u_state, k_to_end, decay_total, q_decayed, attn, states, u, chunk_bounds)
        ctx.launch, ctx.has_initial = launch, initial is not None
        return q_decayed @ states + attn @ u, final

    @staticmethod
    def backward(ctx, o_grad, final_grad):
        u_state, k_to_end, decay_total, q_decayed, attn, states, u, chunk_bounds = ctx.saved_tensors
        o_grad = o_grad.contiguous()
        # What o = q_decayed S + attn u gives each factor
        q_decayed_grad = o_grad @ states.transpose(-1, -2)
        attn_grad = o_grad @ u.transpose(-1, -2)
        states_grad = q_decayed.transpose(-1, -2) @ o_grad
        u_grad = attn.transpose(-1, -2) @ o_grad
        chunks, heads, K, V = states.shape
        num_seqs = chunk_bounds.numel() - 1
        u_total_grad = torch.empty_like(u_grad)
        next_state_grad = torch.empty_like(states)
        initial_grad = states.new_empty(num_seqs, heads, K, V)
        _launch_state_pass(_state_pass_backward, ctx.launch, num_seqs, heads, K, V, u_grad, states_grad, u_state,
                           k_to_end, decay_total, None if final_grad is None else final_grad.contiguous(),
                           u_total_grad, next_state_grad, initial_grad, chunk_bounds,
                           HAS_FINAL_GRAD=final_grad is not None)
        # u = u_values - u_state S and S_(c+1) = decay_total S + k_to_end^T u, summed over every value column
        u_state_grad = -u_total_grad @ states.transpose(-1, -2)
        k_to_end_grad = u @ next_state_grad.transpose(-1, -2)
        decay_total_grad = (states * next_state_grad).sum((-1, -2))
        return (u_total_grad, u_state_grad, k_to_end_grad, decay_total_grad, q_decayed_grad, attn_grad,
                initial_grad if ctx.has_initial else None, None, None)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, launch: TritonLaunch, **unused):
    """fla's chunk_gated_delta_rule contract (relax.kernels.gdn_reference.chunk_gated_delta_rule's docstring), every
    sequence at once; float32 inside, outputs in v's dtype, differentiable. `launch`: the device's launch record
    (Platform.triton_launch)."""
    if unused:
        raise TypeError(f"chunk_gated_delta_rule: unsupported arguments {sorted(unused)}")
    batch, length, num_k_heads, K = q.shape
    heads, V = v.shape[-2:]
    if heads % num_k_heads:
        raise ValueError(f"value heads ({heads}) must be a multiple of query/key heads ({num_k_heads})")
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (batch + 1) * length, length, device=q.device)
    elif batch != 1:
        raise ValueError(f"with cu_seqlens the batch dim must be 1 (sequences packed along T), got {batch}")
    num_seqs = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape[0] != num_seqs:
        raise ValueError(f"initial_state has {initial_state.shape[0]} states for {num_seqs} sequences")
    # Each sequence starts a chunk: token t of sequence n sits at chunk_bounds[n] * CHUNK + (t - cu_seqlens[n]).
    cu_seqlens = cu_seqlens.to(q.device, torch.int64)
    lengths = cu_seqlens.diff()
    chunk_bounds = torch.nn.functional.pad((lengths + CHUNK - 1).div(CHUNK, rounding_mode="floor").cumsum(0), (1, 0))
    chunks = int(chunk_bounds[-1])
    sequence = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), lengths, output_size=batch * length)
    slots = chunk_bounds[sequence] * CHUNK + torch.arange(batch * length, device=q.device) - cu_seqlens[sequence]

    def chunked(x):  # [B, T, h, d] or [B, T, h] -> [chunks, h, CHUNK, d] or [chunks, h, CHUNK], float32
        x = x.float().flatten(0, 1)
        laid = x.new_zeros(chunks * CHUNK, *x.shape[1:]).index_copy(0, slots, x)
        return laid.unflatten(0, (chunks, CHUNK)).transpose(1, 2)

    def rule(q, k, v, g, beta, initial_state):
        if use_qk_l2norm_in_kernel:
            q, k = gdn_reference.l2norm(q.float()), gdn_reference.l2norm(k.float())
        q = q.float() * (K ** -0.5 if scale is None else scale)
        repeat = heads // num_k_heads
        q, k = q.repeat_interleave(repeat, 2), k.repeat_interleave(repeat, 2)
        terms = gdn_reference.chunk_terms(chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta))
        o, final = _StatePass.apply(
            terms.u_values.contiguous(), terms.u_state.contiguous(), terms.k_to_end.contiguous(),
            terms.decay_total.contiguous(), terms.q_decayed, terms.attn,
            None if initial_state is None else initial_state.float().contiguous(), chunk_bounds.to(torch.int32),
            launch,
        )
        return o.transpose(1, 2).flatten(0, 1).index_select(0, slots).unflatten(0, (batch, length)).to(v.dtype), final

    if torch.is_grad_enabled():
        # The chunk terms are float32 and several per token and head (about 7 KB per token and value head of 128):
        # kept for the backward in every layer they would outweigh the layer's other activations many times, so the
        # backward computes them again from the inputs, which are all this keeps (as fla's and MindSpeed's rules do).
        o, final = checkpoint(rule, q, k, v, g, beta, initial_state, use_reentrant=False)
    else:
        o, final = rule(q, k, v, g, beta, initial_state)
    return o, (final if output_final_state else None)
