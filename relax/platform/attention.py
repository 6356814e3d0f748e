"""Causal softmax attention for the training actor, one kernel per platform (Platform.attention_kernel).

Three entry points per kernel, all causal, dropout-free, with grouped-query attention (fewer key/value heads than
query heads) and an explicit softmax scale:
    padded(q, k, v, scale)                           [b, s, heads, d]: rows of one sequence each, right-padded
                                                     (padding comes after the sequence, so causality alone keeps
                                                     it out of every real token's attention: no mask tensor)
    packed(q, k, v, cu_seqlens, max_seqlen, scale)   [t, heads, d]: sequences packed along t, cu_seqlens [n+1]
                                                     int32 their boundaries; no token attends across one
    packed_with_keys(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
                                                     packed, each query sequence with a key sequence of its own, the
                                                     queries being the last positions of their keys (causality
                                                     aligned to the end: of lq queries against lk keys, query j sees
                                                     keys 0 .. j + lk - lq); context parallelism attends a rank's
                                                     chunks of a sequence this way (relax.train.context_parallel)
All return the attention output in the query's shape and dtype.

Kernels:
    "sdpa"         torch's scaled_dot_product_attention; packed rows one sequence at a time (the CPU, and any
                   device as the reference)
    "flash_varlen" torch's flash kernels on CUDA: torch.nn.attention.varlen.varlen_attn for packed rows, SDPA
                   (which picks flash for half precision) for padded ones; float32 falls back to "sdpa"
    "npu_fusion"   torch_npu.npu_fusion_attention in TND layout with the causal sparse mode (the path MindSpeed
                   uses on Ascend). Tested on the CPU only, against a stand-in bound by the op's schema from the
                   torch-npu wheel (tests/npu): no NPU was available.

Context parallelism (Platform.context_parallel_attention): how a CP rank's queries reach the keys of the other ranks.
    "all-gather"      relax's own: the row's keys and values all-gathered over the CP group, then the kernel's
                      packed_with_keys (relax.train.context_parallel)
    "mindspeed-ring"  MindSpeed's ring attention (mindspeed_ring below): keys and values passed around the CP ranks,
                      npu_fusion_attention on each pair of blocks, the partial outputs merged by their softmax
                      statistics; rows it cannot take (mindspeed_ring_takes) go the all-gather way
"""

import functools

import torch
import torch.nn.functional as F

KERNELS = ("sdpa", "flash_varlen", "npu_fusion")
CONTEXT_PARALLEL_ATTENTION = ("all-gather", "mindspeed-ring")


def _sdpa_padded(q, k, v, scale):
    """Rows [b, s, heads, d]; with fewer queries than keys, the queries are the last of the keys' positions (SDPA's own
    is_causal aligns them to the start instead, hence the mask)."""
    query_len, key_len = q.shape[1], k.shape[1]
    end_aligned = None
    if query_len != key_len:
        end_aligned = torch.ones(query_len, key_len, dtype=torch.bool, device=q.device).tril(key_len - query_len)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=end_aligned,
        is_causal=end_aligned is None, scale=scale, enable_gqa=True,
    )
    return out.transpose(1, 2)


def _sdpa_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    query_bounds, key_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outputs = [
        _sdpa_padded(q[None, q_start:q_end], k[None, k_start:k_end], v[None, k_start:k_end], scale)[0]
        for q_start, q_end, k_start, k_end in zip(query_bounds, query_bounds[1:], key_bounds, key_bounds[1:])
    ]
    return torch.cat(outputs)


def _half_precision(q) -> bool:
    return q.dtype in (torch.float16, torch.bfloat16)


@functools.cache
def _varlen_parameters() -> frozenset:
    """The keywords this torch's varlen_attn takes: they changed between releases (torch 2.11's has is_causal and
    no enable_gqa; 2.13's a window_size, a scale and enable_gqa)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _flash_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    if not _half_precision(q):  # flash kernels take fp16 / bf16 only
        return _sdpa_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
    from torch.nn.attention.varlen import varlen_attn

    takes = _varlen_parameters()
    options = {"window_size": (-1, 0)} if "window_size" in takes else {"is_causal": True}
    if "scale" in takes:
        options["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12 * scale:
        raise ValueError(f"this torch's varlen_attn has no scale argument; softmax scale {scale} needs torch >= 2.13")
    if "enable_gqa" in takes:
        options["enable_gqa"] = True
    elif k.shape[1] != q.shape[1]:  # fewer key/value heads: repeated to the query heads
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    # The flash kernels' causal mask is aligned to the end of each key sequence (torch.nn.attention.bias's
    # causal_lower_right calls them with is_causal=True).
    return varlen_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **options)


# npu_fusion_attention's causal mode (sparse_mode=3, rightDownCausal: aligned to the end of each key sequence) reads a
# fixed 2048 x 2048 upper-triangular mask (True = masked) whatever the sequence lengths; MindSpeed builds the same one.
_NPU_CAUSAL_MASK_SIZE = 2048


@functools.cache
def _npu_causal_mask(device) -> torch.Tensor:
    size = _NPU_CAUSAL_MASK_SIZE
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


# npu_fusion_attention's TND layout takes at most 1024 sequences per call (torch-npu 2.10's documentation); a packed
# micro-batch of more short sequences is attended in several calls.
_NPU_MAX_SEQUENCES = 1024


def _npu_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale):
    import torch_npu

    query_bounds, key_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    outputs = []
    for first in range(0, len(query_bounds) - 1, _NPU_MAX_SEQUENCES):
        queries = query_bounds[first : first + _NPU_MAX_SEQUENCES + 1]
        keys = key_bounds[first : first + _NPU_MAX_SEQUENCES + 1]
        outputs.append(torch_npu.npu_fusion_attention(
            q[queries[0] : queries[-1]], k[keys[0] : keys[-1]], v[keys[0] : keys[-1]], q.shape[1],
            input_layout="TND",
            scale=scale,
            keep_prob=1.0,
            sparse_mode=3,
            atten_mask=_npu_causal_mask(q.device),
            # the TND layout takes cumulative ends as host lists
            actual_seq_qlen=[bound - queries[0] for bound in queries[1:]],
            actual_seq_kvlen=[bound - keys[0] for bound in keys[1:]],
        )[0])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _as_packed(packed):
    """A padded-rows entry point made from a packed one: each row becomes one sequence of the full row length."""

    def padded(q, k, v, scale):
        rows, length = q.shape[:2]
        cu_seqlens = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=q.device)
        out = packed(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, cu_seqlens, length, length, scale)
        return out.view(q.shape[:-1] + (v.shape[-1],))

    return padded


_PADDED = {"sdpa": _sdpa_padded, "flash_varlen": _sdpa_padded, "npu_fusion": _as_packed(_npu_packed)}
_PACKED = {"sdpa": _sdpa_packed, "flash_varlen": _flash_packed, "npu_fusion": _npu_packed}


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}: choose one of {', '.join(KERNELS)}")


def check_context_parallel_attention(method: str) -> None:
    if method not in CONTEXT_PARALLEL_ATTENTION:
        raise ValueError(
            f"unknown context-parallel attention {method!r}: choose one of {', '.join(CONTEXT_PARALLEL_ATTENTION)}"
        )


def padded(kernel: str, q, k, v, scale: float):
    """Causal attention over right-padded rows [b, s, heads, d] with `kernel`."""
    return _PADDED[kernel](q, k, v, scale)


def packed(kernel: str, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """Causal attention over sequences packed along t ([t, heads, d], boundaries cu_seqlens) with `kernel`."""
    return _PACKED[kernel](q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scale)


def packed_with_keys(kernel: str, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scale):
    """Causal attention of packed query sequences (boundaries cu_seqlens_q) against key sequences of their own
    (cu_seqlens_k), each sequence's queries the last positions of its keys, with `kernel`."""
    return _PACKED[kernel](q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)


def mindspeed_ring_takes(chunk_cu_seqlens) -> bool:
    """Whether MindSpeed's ring attention takes this CP rank's part of a row (its chunks' boundaries, two chunks per
    sequence): the ring attends all the row's sequences in one npu_fusion_attention call per block, and the TND layout
    takes at most 1024 sequences per call (relax's own path splits the calls)."""
    return (len(chunk_cu_seqlens) - 1) // 2 <= _NPU_MAX_SEQUENCES


@functools.lru_cache(maxsize=8)  # every layer of a micro-batch asks for the same row's
def _first_and_second_chunks(bounds: tuple, device):
    """The positions of the first and of the second chunk of each sequence, from the chunks' boundaries."""
    chunks = [torch.arange(start, end) for start, end in zip(bounds, bounds[1:])]
    return torch.cat(chunks[0::2]).to(device), torch.cat(chunks[1::2]).to(device)


def mindspeed_ring(q, k, v, chunk_cu_seqlens, group, scale: float):
    """Causal attention of this CP rank's queries [t / CP, heads, d] to the keys and values of the whole row, with
    MindSpeed's ring attention (ringattn_context_parallel: AttentionWithCp in its causal eod-reset TND mode, what
    MindSpeed's own DotProductAttention calls for packed rows under megatron_cp_algo).

    The rank holds chunks r and 2 CP - 1 - r of every sequence, in that order (relax.train.context_parallel;
    `chunk_cu_seqlens`: their boundaries), which is MindSpeed's split of an eod-reset row (get_batch_utils.py,
    _get_batch_on_this_cp_rank_in_megatron_cp_eod_padding): each local sequence of 2 chunks is the unit of its TND
    calls, kv_index its first chunks (those a later rank's queries attend to) and q_index its second (those that
    attend to both chunks of a later rank). Sequence ends are TND's cumulative ends, without the leading 0."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams
    from mindspeed.core.context_parallel.ring_context_parallel.ring_context_parallel import ringattn_context_parallel

    bounds = tuple(chunk_cu_seqlens.tolist())
    sequence_ends = torch.tensor(bounds[2::2])
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=sequence_ends, cu_seqlens_kv=sequence_ends)
    params.kv_index, params.q_index = _first_and_second_chunks(bounds, q.device)
    cp_para = {
        "causal": True,
        "cp_group": group,
        "cp_size": dist.get_world_size(group),
        "rank": dist.get_rank(group),
        "cp_global_ranks": dist.get_process_group_ranks(group),
    }
    return ringattn_context_parallel(q, k, v, q.shape[1], cp_para, scale, None, 0.0, params)
