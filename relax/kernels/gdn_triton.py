"""Triton kernels for GDN decode; each has its torch reference in gdn_reference (same name, same arguments,
plus the launch record): gdn_decode (the fused step), causal_conv1d_update, gdn_gating, gated_rms_norm.

Written to triton-ascend's porting rules so one source runs on NVIDIA GPUs and Ascend NPUs:
- every launch is a 1-D grid of at most `launch.num_programs` programs (the device's core count, or cores times
  resident programs on a GPU), each looping over work items with a stride of the grid size;
- launch keywords such as num_warps / num_stages come only from `launch.options` (empty on NPU), never from here
  (gdn_decode also reads num_stages as how far ahead it loads state tiles: 2 = one tile ahead, else none);
- on-chip buffers are bounded: the recurrent state is streamed in [block_v, K] tiles, never a whole [V, K] head;
- the only cross-program hand-off (gdn_decode with programs_per_group > 1) is an int32 atomic_add with
  sem="acq_rel" after a debug_barrier, both in triton-ascend's supported set.
The per-device values are relax.kernels.launch's (each Triton target's tuning, the H200's measured);
`decode_tiling` turns a launch record and a batch into one gdn_decode call's block_v / programs_per_group / launch.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from relax.kernels.gdn_reference import QKVZ_LAYOUTS
from relax.kernels.launch import TritonLaunch
from relax.kernels.sgl_kernel_npu.gdn_decode import delta_rule_tile, gdn_log_decay


@triton.jit
def _conv_window(x_ptr, state_ptr, channels, mask, channel_stride, tap_stride, W: tl.constexpr, BW: tl.constexpr):
    """[C, BW] float32: each channel's W-1 stored inputs (oldest first) then its new input; taps >= W are zero.

    x_ptr points at each channel's new input, state_ptr at the slot's [conv_dim, W-1] conv state, whose element
    (c, t) sits at c * channel_stride + t * tap_stride (SGLang's CUDA pool: W-1, 1; its Ascend pool: 1, conv_dim).
    """
    taps = tl.arange(0, BW)
    window = tl.load(state_ptr + channels[:, None] * channel_stride + taps[None, :] * tap_stride,
                     mask=mask[:, None] & (taps[None, :] < W - 1), other=0.0)
    x = tl.load(x_ptr, mask=mask, other=0.0)
    return tl.where(taps[None, :] == W - 1, x[:, None], window).to(tl.float32)


@triton.jit
def _conv_silu(window, weight_ptr, bias_ptr, channels, mask, W: tl.constexpr, BW: tl.constexpr,
               HAS_BIAS: tl.constexpr):
    """silu(sum over taps of window * weight + bias) per channel, float32."""
    taps = tl.arange(0, BW)
    weight = tl.load(weight_ptr + channels[:, None] * W + taps[None, :], mask=mask[:, None] & (taps[None, :] < W),
                     other=0.0).to(tl.float32)
    y = tl.sum(window * weight, axis=1)
    if HAS_BIAS:
        y += tl.load(bias_ptr + channels, mask=mask, other=0.0).to(tl.float32)
    return y * tl.sigmoid(y)


@triton.jit
def _store_shifted_window(window, state_ptr, channels, mask, channel_stride, tap_stride, W: tl.constexpr,
                          BW: tl.constexpr):
    """The window minus its oldest input becomes the new conv state: tap t is stored at t - 1."""
    taps = tl.arange(0, BW)
    tl.store(state_ptr + channels[:, None] * channel_stride + (taps[None, :] - 1) * tap_stride,
             window.to(state_ptr.dtype.element_ty),
             mask=mask[:, None] & (taps[None, :] >= 1) & (taps[None, :] < W))


@triton.jit
def _gated_norm_store(o, z, weight_ptr, weight_offs, out_ptr, offs, mask, tile_head, V: tl.constexpr, norm_eps):
    """Store o / rms(o) * weight * silu(z) for a key head's group of value heads; o, z, the weight's and the
    output's offsets, mask: [BGT, BV] (value tile of the group, row in tile), tile_head [BGT]: each tile's value
    head. The weight is read here, not held through the tile loop: that would cost registers there."""
    tile_sq = tl.sum(o * o, axis=1)
    head_sq = tl.sum(tl.where(tile_head[:, None] == tile_head[None, :], tile_sq[None, :], 0.0), axis=1)
    rstd = tl.rsqrt(head_sq / V + norm_eps)
    weight = tl.load(weight_ptr + weight_offs, mask=mask, other=0.0).to(tl.float32)
    y = o * rstd[:, None] * weight * z * tl.sigmoid(z)
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _state_tile(state_group, i, end_tile, rows_in_tile, offs_k, mask_k, K: tl.constexpr, V: tl.constexpr,
                NT: tl.constexpr, BV: tl.constexpr):
    """Pointers [BV, K] to the group's state tile i (rows of value head i // NT) and their mask: rows past the
    head's V, columns past K, and the whole tile once i reaches end_tile are masked."""
    offs_v = (i % NT) * BV + rows_in_tile
    pointers = state_group + (i // NT) * V * K + offs_v[:, None] * K + offs_k[None, :]
    rows_left = tl.where(i < end_tile, V - (i % NT) * BV, 0)
    return pointers, (rows_in_tile < rows_left)[:, None] & mask_k[None, :]


@triton.jit
def _gdn_decode_kernel(
    qkvz_ptr, ba_ptr, conv_state_ptr, conv_weight_ptr, conv_bias_ptr, state_ptr, slot_ptr,
    A_log_ptr, dt_bias_ptr, norm_weight_ptr, out_ptr, ticket_ptr,
    num_rows, qkvz_row_stride, ba_row_stride, conv_slot_stride, conv_channel_stride, conv_tap_stride,
    state_slot_stride,
    scale, norm_eps,
    HK: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, NT: tl.constexpr, BGT: tl.constexpr, BW: tl.constexpr,
    P: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_CONV_BIAS: tl.constexpr, EVEN: tl.constexpr,
    TILE_STAGES: tl.constexpr,
):
    """One work item = one token row x one key head x one of its P parts (R = HV // HK value heads share the
    key head's q/k conv channels). The group's R * NT value tiles of [BV, K] state rows are numbered
    i = head * NT + tile; small per-row vectors are held as [BGT, BV] (tile i, row in tile; BGT = R * NT rounded
    up to a power of two).

    P == 1: the part is the whole group, every value head and tile; it shifts the q/k conv windows itself, as
    soon as it has read them, and reads z before the tile loop.
    P == R * SPLITS: a part is one value head and every SPLITS-th state tile of it. Every part reads the
    old q/k window, updates its tiles, stores its un-normalised outputs, then takes an arrival ticket; the last
    part to arrive (all others have read and stored by then) writes the shifted q/k window, applies the gated
    RMSNorm to the group's outputs and resets the ticket to zero for the next call.
    The q/k/v conv windows are read before the loop over state tiles, so that loop mostly streams the state.
    TILE_STAGES = 2: each state tile is loaded one step ahead (the first while the conv windows are read), so a
    program keeps a load in flight while it updates a tile; 1: load, update, store one tile at a time.
    """
    R: tl.constexpr = HV // HK
    HEADS: tl.constexpr = R if P == 1 else 1  # value heads per part
    SPLITS: tl.constexpr = 1 if P == 1 else P // R  # parts per value head
    offs_k = tl.arange(0, BK)
    mask_k = offs_k < K
    rows_in_tile = tl.arange(0, BV)
    tiles = tl.arange(0, BGT)
    tile_head = tiles // NT
    pos_in_head = (tiles % NT)[:, None] * BV + rows_in_tile[None, :]  # [BGT, BV]
    in_group = (tiles < R * NT)[:, None] & (pos_in_head < V)
    group_offs = tile_head[:, None] * V + pos_in_head  # within the group's R * V values
    # the same positions flattened, for the v conv channels
    flat = tl.arange(0, BGT * BV)
    flat_tile = flat // BV
    flat_pos = (flat_tile % NT) * BV + flat % BV
    flat_in_group = (flat_tile < R * NT) & (flat_pos < V)
    for item in range(tl.program_id(0), num_rows * HK * P, tl.num_programs(0)):
        row = item // (HK * P)
        hk = (item // P) % HK
        first_head = (item % P) // SPLITS  # within the group
        split = item % SPLITS
        first_tile = first_head * NT + split
        end_tile = (first_head + HEADS) * NT
        owned_tiles = (tiles >= first_tile) & (tiles < end_tile) & ((tiles % NT) % SPLITS == split)
        owned = in_group & owned_tiles[:, None]
        out_group = out_ptr + (row * HV + hk * R) * V
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot < 0:  # padding row: no state touched, zero output
            tl.store(out_group + group_offs, tl.zeros([BGT, BV], dtype=out_ptr.dtype.element_ty), mask=owned)
        else:
            state_group = state_ptr + slot * state_slot_stride + hk * R * V * K
            if TILE_STAGES > 1:  # the first state tile is on its way while the small inputs are read
                first, first_mask = _state_tile(state_group, first_tile, end_tile, rows_in_tile, offs_k, mask_k, K,
                                                V, NT, BV)
                s_next = tl.load(first, mask=first_mask, other=0.0)
            qkvz_row = qkvz_ptr + row * qkvz_row_stride
            ba_row = ba_ptr + row * ba_row_stride
            if INTERLEAVED:  # per key head: [q K | k K | v R*V | z R*V], [b R | a R]
                q_in = qkvz_row + hk * (2 * K + 2 * R * V)
                k_in = q_in + K
                v_in = q_in + 2 * K
                z_in = v_in + R * V
                b_in = ba_row + hk * 2 * R
                a_in = b_in + R
            else:  # [q HK*K | k HK*K | v HV*V | z HV*V], [b HV | a HV]
                q_in = qkvz_row + hk * K
                k_in = qkvz_row + HK * K + hk * K
                v_in = qkvz_row + 2 * HK * K + hk * R * V
                z_in = v_in + HV * V
                b_in = ba_row + hk * R
                a_in = ba_row + HV + hk * R
            conv_state = conv_state_ptr + slot * conv_slot_stride
            q_channels = hk * K + offs_k
            k_channels = HK * K + hk * K + offs_k
            q_window = _conv_window(q_in + offs_k, conv_state, q_channels, mask_k, conv_channel_stride,
                                    conv_tap_stride, W, BW)
            k_window = _conv_window(k_in + offs_k, conv_state, k_channels, mask_k, conv_channel_stride,
                                    conv_tap_stride, W, BW)
            if P == 1:  # no other program reads this group's q/k windows: shifted right away, which frees registers
                tl.debug_barrier()  # every warp has read the windows: Triton may replicate a window across warps
                _store_shifted_window(q_window, conv_state, q_channels, mask_k, conv_channel_stride,
                                      conv_tap_stride, W, BW)
                _store_shifted_window(k_window, conv_state, k_channels, mask_k, conv_channel_stride,
                                      conv_tap_stride, W, BW)
            q = _conv_silu(q_window, conv_weight_ptr, conv_bias_ptr, q_channels, mask_k, W, BW, HAS_CONV_BIAS)
            k = _conv_silu(k_window, conv_weight_ptr, conv_bias_ptr, k_channels, mask_k, W, BW, HAS_CONV_BIAS)
            q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
            k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
            # v of this part's tiles; their conv channels belong to this part alone: shifted right away
            flat_owned = flat_in_group & (flat_tile >= first_tile) & (flat_tile < end_tile) & (
                (flat_tile % NT) % SPLITS == split)
            v_channels = 2 * HK * K + hk * R * V + (flat_tile // NT) * V + flat_pos
            v_window = _conv_window(v_in + (flat_tile // NT) * V + flat_pos, conv_state, v_channels, flat_owned,
                                    conv_channel_stride, conv_tap_stride, W, BW)
            v = _conv_silu(v_window, conv_weight_ptr, conv_bias_ptr, v_channels, flat_owned, W, BW, HAS_CONV_BIAS)
            tl.debug_barrier()  # as for q/k: no warp shifts the window before all have read it
            _store_shifted_window(v_window, conv_state, v_channels, flat_owned, conv_channel_stride,
                                  conv_tap_stride, W, BW)
            v = tl.reshape(v, (BGT, BV))
            kq = tl.sum(k * q)
            if P == 1:  # read now, so its latency is not added after the last tile
                z = tl.load(z_in + group_offs, mask=in_group, other=0.0).to(tl.float32)
            o = tl.zeros([BGT, BV], dtype=tl.float32)
            for i in range(first_tile, end_tile, SPLITS):
                head = i // NT
                h = hk * R + head
                decay = tl.exp(gdn_log_decay(tl.load(a_in + head).to(tl.float32), tl.load(A_log_ptr + h).to(tl.float32),
                                             tl.load(dt_bias_ptr + h).to(tl.float32), 1.0, 20.0))
                beta = tl.sigmoid(tl.load(b_in + head).to(tl.float32))
                v_tile = tl.sum(tl.where(tiles[:, None] == i, v, 0.0), axis=0)
                # State tile [BV, K] of the pool's [V, K] head
                tile, tile_mask = _state_tile(state_group, i, end_tile, rows_in_tile, offs_k, mask_k, K, V, NT, BV)
                if TILE_STAGES > 1:  # this tile was loaded one step ahead; now the next one is
                    s = s_next
                    next_tile, next_mask = _state_tile(state_group, i + SPLITS, end_tile, rows_in_tile, offs_k,
                                                       mask_k, K, V, NT, BV)
                    s_next = tl.load(next_tile, mask=next_mask, other=0.0)
                elif EVEN:
                    s = tl.load(tile)
                else:
                    s = tl.load(tile, mask=tile_mask, other=0.0)
                s, o_tile = delta_rule_tile(s.to(tl.float32), k, q, v_tile, decay, beta, kq)
                if EVEN:
                    tl.store(tile, s.to(state_ptr.dtype.element_ty))
                else:
                    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=tile_mask)
                o = tl.where(tiles[:, None] == i, o_tile[None, :], o)

            if P == 1:
                _gated_norm_store(o, z, norm_weight_ptr, pos_in_head, out_group, group_offs, in_group, tile_head, V,
                                  norm_eps)
            else:  # un-normalised, for the group's last part
                tl.store(out_group + group_offs, o.to(out_ptr.dtype.element_ty), mask=owned)
                tl.debug_barrier()  # all of this program's reads and stores come before its ticket
                ticket = tl.atomic_add(ticket_ptr + row * HK + hk, 1, sem="acq_rel")
                if ticket == P - 1:  # the group's last part to arrive
                    _store_shifted_window(q_window, conv_state, q_channels, mask_k, conv_channel_stride,
                                          conv_tap_stride, W, BW)
                    _store_shifted_window(k_window, conv_state, k_channels, mask_k, conv_channel_stride,
                                          conv_tap_stride, W, BW)
                    o_raw = tl.load(out_group + group_offs, mask=in_group, other=0.0).to(tl.float32)
                    z = tl.load(z_in + group_offs, mask=in_group, other=0.0).to(tl.float32)
                    _gated_norm_store(o_raw, z, norm_weight_ptr, pos_in_head, out_group, group_offs, in_group,
                                      tile_head, V, norm_eps)
                    tl.store(ticket_ptr + row * HK + hk, 0)


@triton.jit
def _causal_conv1d_update_kernel(x_ptr, conv_state_ptr, weight_ptr, bias_ptr, slot_ptr, y_ptr, num_rows, dim,
                                 x_row_stride, conv_slot_stride, conv_channel_stride, conv_tap_stride,
                                 W: tl.constexpr, BD: tl.constexpr,
                                 BW: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
    """One work item = one row x BD channels (channels never share state, so blocks are independent)."""
    blocks = tl.cdiv(dim, BD)
    for item in range(tl.program_id(0), num_rows * blocks, tl.num_programs(0)):
        row = item // blocks
        channels = (item % blocks) * BD + tl.arange(0, BD)
        mask = channels < dim
        slot = tl.load(slot_ptr + row).to(tl.int64)
        if slot < 0:  # padding row: no state touched, zero output
            tl.store(y_ptr + row * dim + channels, tl.zeros([BD], dtype=y_ptr.dtype.element_ty), mask=mask)
        else:
            state = conv_state_ptr + slot * conv_slot_stride
            window = _conv_window(x_ptr + row * x_row_stride + channels, state, channels, mask, conv_channel_stride,
                                  conv_tap_stride, W, BW)
            taps = tl.arange(0, BW)
            weight = tl.load(weight_ptr + channels[:, None] * W + taps[None, :],
                             mask=mask[:, None] & (taps[None, :] < W), other=0.0).to(tl.float32)
            y = tl.sum(window * weight, axis=1)
            if HAS_BIAS:
                y += tl.load(bias_ptr + channels, mask=mask, other=0.0).to(tl.float32)
            if SILU:
                y = y * tl.sigmoid(y)
            tl.debug_barrier()  # every warp has read the window before any shifts it in place
            _store_shifted_window(window, state, channels, mask, conv_channel_stride, conv_tap_stride, W, BW)
            tl.store(y_ptr + row * dim + channels, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gdn_gating_kernel(A_log_ptr, a_ptr, b_ptr, dt_bias_ptr, g_ptr, beta_ptr, num_rows, heads, a_row_stride,
                       b_row_stride, softplus_beta, softplus_threshold, BH: tl.constexpr):
    """One work item = one row of heads: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""
    offs = tl.arange(0, BH)
    mask = offs < heads
    A_log = tl.load(A_log_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        a = tl.load(a_ptr + row * a_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(g_ptr + row * heads + offs, gdn_log_decay(a, A_log, dt_bias, softplus_beta, softplus_threshold),
                 mask=mask)
        b = tl.load(b_ptr + row * b_row_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(beta_ptr + row * heads + offs, tl.sigmoid(b), mask=mask)


@triton.jit
def _gated_rms_norm_kernel(x_ptr, z_ptr, weight_ptr, out_ptr, num_rows, dim, eps, BD: tl.constexpr):
    """One work item = one row: x / rms(x) * weight * silu(z), float32 inside."""
    offs = tl.arange(0, BD)
    mask = offs < dim
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    for row in range(tl.program_id(0), num_rows, tl.num_programs(0)):
        x = tl.load(x_ptr + row * dim + offs, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * dim + offs, mask=mask, other=0.0).to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x) / dim + eps) * weight * z * tl.sigmoid(z)
        tl.store(out_ptr + row * dim + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(condition: bool, message: str):
    if not condition:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class DecodeTiling:
    """How one gdn_decode call divides its work: its block_v, programs_per_group and launch record."""

    block_v: int
    programs_per_group: int
    launch: TritonLaunch

    def describe(self) -> str:
        options = dict(self.launch.options)
        return f"block_v={self.block_v} programs_per_group={self.programs_per_group} options={options}"


def unsplit_tiling(launch: TritonLaunch) -> DecodeTiling:
    """One program per key head's group, with the device's tile."""
    return DecodeTiling(launch.decode_block_v, 1, launch)


def split_tiling(splits: int, num_k_heads: int, num_v_heads: int, head_v_dim: int,
                 launch: TritonLaunch) -> DecodeTiling:
    """Each value head of a group split `splits` ways (a power of two): programs_per_group = Hv // H * splits,
    each program taking one value head and every splits-th state tile of it. The tile is the device's, made
    smaller where needed so that each program gets at least one tile (head_v_dim // splits rows, rounded down to
    a power of two): with splits = V / 16 on an H200 each program streams a single 16-row tile. The launch
    takes the record's split options (tile prefetch on an H200)."""
    _check(splits > 0 and splits & (splits - 1) == 0, f"splits={splits} must be a power of two")
    _check(head_v_dim // splits >= 1, f"splits={splits} leaves no state rows of head_v_dim={head_v_dim}")
    block_v = min(launch.decode_block_v, 1 << ((head_v_dim // splits).bit_length() - 1))
    options = {**launch.options, **launch.decode_split_options}
    return DecodeTiling(block_v, num_v_heads // num_k_heads * splits, dataclasses.replace(launch, options=options))


def decode_tiling(rows: int, num_k_heads: int, num_v_heads: int, head_v_dim: int,
                  launch: TritonLaunch) -> DecodeTiling:
    """The launch policy of gdn_decode for a batch of `rows` on the device of `launch`.

    With rows x num_k_heads work items of one program each, a small batch leaves most of a GPU idle (batch 1 of
    Qwen3.5-9B: 16 programs on 132 SMs). So each value head is split into the most ways (a power of two) that
    keeps rows x num_k_heads x programs_per_group within launch.decode_split_items and every tile at least
    launch.decode_split_min_block_v rows; batches where even one program per value head exceeds that bound,
    and records with decode_split_items = 0 (the NPU), run unsplit. Splitting costs a second read of q/k, an
    arrival ticket and a re-read of the outputs per group, which measured slower from batch 64 up on an H200.
    Every split choice has rows x num_k_heads <= decode_split_items, so a tickets buffer of
    decode_split_items int32 serves any batch.
    """
    ratio = num_v_heads // num_k_heads
    max_splits = head_v_dim // launch.decode_split_min_block_v
    if rows * num_k_heads * ratio > launch.decode_split_items or max_splits < 1:
        return unsplit_tiling(launch)
    splits = 1
    while splits * 2 <= max_splits and rows * num_k_heads * ratio * splits * 2 <= launch.decode_split_items:
        splits *= 2
    if ratio * splits == 1:  # one value head per key head and no room to split it: nothing to share
        return unsplit_tiling(launch)
    return split_tiling(splits, num_k_heads, num_v_heads, head_v_dim, launch)


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
    launch: TritonLaunch,
    block_v: int = 64,
    programs_per_group: int = 1,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused GDN decode step; same arguments and result as gdn_reference.gdn_decode, plus the launch record.

    One kernel: QKVZBA split, conv1d state update + silu, q/k l2norm, gating, delta-rule update of the pooled
    state [num_slots, Hv, V, K] and gated RMSNorm; both pools are updated in place. Returns [N, Hv, V].
    Rows must name distinct slots (rows run concurrently); a negative slot marks a padding row.
    block_v: value rows of the state streamed per step (the on-chip tile is block_v x K).
    programs_per_group: programs sharing one key head's group of Hv // H value heads. 1: one program does the
        whole group (fastest when there are enough rows to fill the device). A multiple of Hv // H: each program
        takes one value head and every (programs_per_group // (Hv // H))-th state tile of it, for parallelism
        at small batch; the last to finish applies the norm, counted with `tickets`.
    tickets: int32 zeros, at least N * num_k_heads, used when programs_per_group > 1; the kernel leaves them
        zero, so one buffer serves every call (and CUDA-graph replays). Allocated per call when None.
    Where `launch.options["num_stages"]` is 2 or more, each state tile is loaded one step ahead of its update.
    """
    num_v_heads = A_log.shape[0]
    _check(layout in QKVZ_LAYOUTS, f"layout={layout!r}: use one of {QKVZ_LAYOUTS}")
    _check(num_v_heads % num_k_heads == 0,
           f"num_v_heads ({num_v_heads}) must be a multiple of num_k_heads ({num_k_heads})")
    rows = mixed_qkvz.shape[0]
    conv_dim = 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim
    width = conv_weight.shape[-1]
    _check(mixed_qkvz.dim() == 2 and mixed_qkvz.shape[1] == conv_dim + num_v_heads * head_v_dim
           and mixed_qkvz.stride(1) == 1, f"mixed_qkvz must be [N, {conv_dim + num_v_heads * head_v_dim}] with "
           f"contiguous rows, got {tuple(mixed_qkvz.shape)} strides {mixed_qkvz.stride()}")
    _check(mixed_ba.shape == (rows, 2 * num_v_heads) and mixed_ba.stride(1) == 1,
           f"mixed_ba must be [{rows}, {2 * num_v_heads}] with contiguous rows, got {tuple(mixed_ba.shape)}")
    _check(conv_weight.shape == (conv_dim, width) and conv_weight.is_contiguous(),
           f"conv_weight must be a contiguous [{conv_dim}, W], got {tuple(conv_weight.shape)}")
    _check(conv_state_pool.shape[1:] == (conv_dim, width - 1),
           f"conv_state_pool must be [num_slots, {conv_dim}, {width - 1}] (any strides), got "
           f"{tuple(conv_state_pool.shape)}")
    _check(state_pool.shape[1:] == (num_v_heads, head_v_dim, head_k_dim) and state_pool[0].is_contiguous(),
           f"state_pool must be [num_slots, {num_v_heads}, {head_v_dim}, {head_k_dim}] (the [V, K] pool layout), "
           f"got {tuple(state_pool.shape)}")
    _check(slot_indices.shape == (rows,), f"slot_indices must be [{rows}], got {tuple(slot_indices.shape)}")
    _check(block_v > 0 and block_v & (block_v - 1) == 0, f"block_v={block_v} must be a power of two")
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    num_tiles = triton.cdiv(head_v_dim, block_v)
    ratio = num_v_heads // num_k_heads
    _check(programs_per_group == 1 or (programs_per_group % ratio == 0 and programs_per_group // ratio <= num_tiles),
           f"programs_per_group={programs_per_group} must be 1 or a multiple of Hv // H = {ratio} of at most "
           f"{ratio * num_tiles} (the value tiles of block_v={block_v})")
    if programs_per_group > 1:
        if tickets is None:
            tickets = torch.zeros(rows * num_k_heads, dtype=torch.int32, device=mixed_qkvz.device)
        _check(tickets.dtype == torch.int32 and tickets.numel() >= rows * num_k_heads,
               f"tickets must be int32 with at least {rows * num_k_heads} elements, got {tickets.dtype} "
               f"x {tickets.numel()}")
    out = mixed_qkvz.new_empty(rows, num_v_heads, head_v_dim)
    grid = (max(1, min(rows * num_k_heads * programs_per_group, launch.num_programs)),)
    head_k_block = triton.next_power_of_2(head_k_dim)
    _gdn_decode_kernel[grid](
        mixed_qkvz, mixed_ba, conv_state_pool, conv_weight, conv_bias, state_pool, slot_indices,
        A_log, dt_bias, norm_weight, out, tickets,
        rows, mixed_qkvz.stride(0), mixed_ba.stride(0), *conv_state_pool.stride(), state_pool.stride(0),
        head_k_dim ** -0.5, norm_eps,
        HK=num_k_heads, HV=num_v_heads, K=head_k_dim, V=head_v_dim, W=width,
        BK=head_k_block, BV=block_v, NT=num_tiles, BGT=triton.next_power_of_2(ratio * num_tiles),
        BW=triton.next_power_of_2(width), P=programs_per_group,
        INTERLEAVED=layout == "interleaved", HAS_CONV_BIAS=conv_bias is not None,
        EVEN=head_k_block == head_k_dim and head_v_dim % block_v == 0,
        TILE_STAGES=min(launch.options.get("num_stages", 1), 2),
        **launch.options,
    )
    return out


def causal_conv1d_update(x, conv_state_pool, weight, bias, activation, slot_indices, launch: TritonLaunch,
                         block_channels: int = 256):
    """Triton gdn_reference.causal_conv1d_update: x [N, D] (rows may be strided), pool [num_slots, D, W-1]."""
    _check(activation in (None, "silu", "swish"), f"activation={activation!r}: use None, 'silu' or 'swish'")
    rows, dim = x.shape
    width = weight.shape[-1]
    _check(x.stride(1) == 1, f"x must have contiguous rows, got strides {x.stride()}")
    _check(weight.shape == (dim, width) and weight.is_contiguous(), f"weight must be a contiguous [{dim}, W]")
    _check(conv_state_pool.shape[1:] == (dim, width - 1),
           f"conv_state_pool must be [num_slots, {dim}, {width - 1}] (any strides), got "
           f"{tuple(conv_state_pool.shape)}")
    _check(slot_indices.shape == (rows,), f"slot_indices must be [{rows}], got {tuple(slot_indices.shape)}")
    y = torch.empty(rows, dim, dtype=x.dtype, device=x.device)
    blocks = triton.cdiv(dim, block_channels)
    _causal_conv1d_update_kernel[(max(1, min(rows * blocks, launch.num_programs)),)](
        x, conv_state_pool, weight, bias, slot_indices, y, rows, dim, x.stride(0), *conv_state_pool.stride(),
        W=width, BD=block_channels, BW=triton.next_power_of_2(width), HAS_BIAS=bias is not None,
        SILU=activation is not None, **launch.options)
    return y


def gdn_gating(A_log, a, b, dt_bias, launch: TritonLaunch, softplus_beta=1.0, softplus_threshold=20.0):
    """Triton gdn_reference.gdn_gating for a, b [N, Hv] (rows may be strided): float32 (g, beta) [N, Hv]."""
    rows, heads = a.shape
    _check(b.shape == a.shape and a.stride(1) == 1 and b.stride(1) == 1,
           f"a and b must both be [N, Hv] with contiguous rows, got {tuple(a.shape)} and {tuple(b.shape)}")
    g = torch.empty(rows, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    _gdn_gating_kernel[(max(1, min(rows, launch.num_programs)),)](
        A_log, a, b, dt_bias, g, beta, rows, heads, a.stride(0), b.stride(0), softplus_beta, softplus_threshold,
        BH=triton.next_power_of_2(heads), **launch.options)
    return g, beta


def gated_rms_norm(x, z, weight, eps, launch: TritonLaunch):
    """Triton gdn_reference.gated_rms_norm over the last dim of contiguous x and z (same shape)."""
    _check(x.shape == z.shape and x.is_contiguous() and z.is_contiguous(),
           f"x and z must be contiguous and of one shape, got {tuple(x.shape)} and {tuple(z.shape)}")
    dim = x.shape[-1]
    out = torch.empty_like(x)
    rows = x.numel() // dim
    _gated_rms_norm_kernel[(max(1, min(rows, launch.num_programs)),)](
        x, z, weight, out, rows, dim, eps, BD=triton.next_power_of_2(dim), **launch.options)
    return out
