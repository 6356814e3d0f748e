"""The double's ring attention: the contract of `ringattn_context_parallel` in the causal eod-reset (TND) mode relax
calls (relax/platform/attention.py mindspeed_ring), and its result.

Upstream (mindspeed/core/context_parallel/ring_context_parallel/ring_context_parallel.py at the pin):
ringattn_context_parallel(q, k, v, n, cp_para, softmax_scale, attn_mask, dropout_p, packed_seq_params) runs
AttentionWithCp. With packed_seq_params whose cu_seqlens_q_padded is None it reads the rank's TND sequence ends from
cu_seqlens_q and cu_seqlens_kv (cumulative ends of the rank's local sequences, no leading 0), and the rank's halves of
each local sequence from packed_seq_params.kv_index (the first halves) and q_index (the second): each local sequence
is the rank's chunks r and 2 * cp_size - 1 - r of a sequence of the row (get_batch_utils.py
_get_batch_on_this_cp_rank_in_megatron_cp_eod_padding). cp_para's causal, cp_group, cp_size, rank and
cp_global_ranks say the ring; attn_mask None makes it build the causal 2048 x 2048 mask; the result is the attention
output [T, n, Dv] of the rank's queries to the keys of their whole sequences.

The double checks those arguments and computes the same attention its own way: the ranks' keys and values gathered
over cp_group, each local query attending to its sequence's keys up to its position. No upstream code is copied."""

import torch
import torch.distributed as dist


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(f"mindspeed (double) ringattn_context_parallel: {message}")


def _positions(ends: list, chunk_rank: int, size: int) -> list:
    """Each local token's (sequence, position in its sequence) on the rank holding chunks chunk_rank and
    2 * size - 1 - chunk_rank of every sequence."""
    positions = []
    for sequence, (start, end) in enumerate(zip([0] + ends[:-1], ends)):
        half = (end - start) // 2
        for number in (chunk_rank, 2 * size - 1 - chunk_rank):
            positions.extend((sequence, number * half + i) for i in range(half))
    return positions


def ringattn_context_parallel(q, k, v, n, cp_para, softmax_scale=None, attn_mask=None, dropout_p=0.0,
                              packed_seq_params=None, shapes=None):
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

    group = cp_para["cp_group"]
    size = dist.get_world_size(group)
    _require(cp_para["causal"] is True, "the double models the causal mode only")
    _require(cp_para["cp_size"] == size, f"cp_size {cp_para['cp_size']} is not cp_group's size {size}")
    _require(cp_para["rank"] == dist.get_rank(group), "rank is not this process's rank in cp_group")
    _require(cp_para["cp_global_ranks"] == dist.get_process_group_ranks(group), "cp_global_ranks are not cp_group's")
    _require(attn_mask is None and dropout_p == 0.0 and shapes is None, "the double models the eod-reset causal mode")
    _require(q.dim() == k.dim() == v.dim() == 3 and n == q.shape[1], "q, k, v are TND [T, n, D]")
    params = packed_seq_params
    _require(params is not None and params.cu_seqlens_q_padded is None, "the sequence ends come in cu_seqlens_q/kv")
    ends = params.cu_seqlens_q.tolist()
    _require(params.cu_seqlens_kv.tolist() == ends, "cu_seqlens_kv differs from cu_seqlens_q")
    lengths = [end - start for start, end in zip([0] + ends[:-1], ends)]
    _require(ends[-1] == q.shape[0] and all(length > 0 and length % 2 == 0 for length in lengths),
             f"cumulative ends of local sequences of two equal chunks, without the leading 0, ending at T; got {ends}")
    halves = [torch.arange(start, start + length // 2) for start, length in zip([0] + ends[:-1], lengths)]
    _require(torch.equal(params.kv_index.cpu(), torch.cat(halves)), "kv_index is not the first half of each sequence")
    _require(torch.equal(params.q_index.cpu(), torch.cat([h + len(h) for h in halves])),
             "q_index is not the second half of each sequence")

    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    gathered = gather_from_sequence_parallel_region(
        torch.cat([k, v], -1), tensor_parallel_output_grad=True, group=group
    )
    keys, values = gathered.split([k.shape[-1], v.shape[-1]], dim=-1)
    key_positions = [p for chunk_rank in range(size) for p in _positions(ends, chunk_rank, size)]
    query_positions = _positions(ends, cp_para["rank"], size)
    key_sequence, key_position = (torch.tensor(column, device=q.device) for column in zip(*key_positions))
    query_sequence, query_position = (torch.tensor(column, device=q.device) for column in zip(*query_positions))
    visible = (query_sequence[:, None] == key_sequence[None]) & (key_position[None] <= query_position[:, None])
    group_size = n // k.shape[1]
    logits = scale * torch.einsum("qnd,knd->nqk", q.float(), keys.float().repeat_interleave(group_size, dim=1))
    weights = logits.masked_fill(~visible, float("-inf")).softmax(-1)
    out = torch.einsum("nqk,knd->qnd", weights, values.float().repeat_interleave(group_size, dim=1))
    return out.to(q.dtype)
