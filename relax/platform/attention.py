"""Causal softmax attention for the training actor, one kernel per platform (Platform.attention_kernel).

Two entry points per kernel, both causal, dropout-free, with grouped-query attention (fewer key/value heads than
query heads) and an explicit softmax scale:
    padded(q, k, v, scale)                           [b, s, heads, d]: rows of one sequence each, right-padded
                                                     (padding comes after the sequence, so causality alone keeps
                                                     it out of every real token's attention: no mask tensor)
    packed(q, k, v, cu_seqlens, max_seqlen, scale)   [t, heads, d]: sequences packed along t, cu_seqlens [n+1]
                                                     int32 their boundaries; no token attends across one
Both return the attention output in the query's shape and dtype.

Kernels:
    "sdpa"         torch's scaled_dot_product_attention; packed rows one sequence at a time (the CPU, and any
                   device as the reference)
    "flash_varlen" torch's flash kernels on CUDA: torch.nn.attention.varlen.varlen_attn for packed rows, SDPA
                   (which picks flash for half precision) for padded ones; float32 falls back to "sdpa"
    "npu_fusion"   torch_npu.npu_fusion_attention in TND layout with the causal sparse mode (the path MindSpeed
                   uses on Ascend). Tested on the CPU only, against a stand-in bound by the op's schema from the
                   torch-npu wheel (tests/npu): no NPU was available.
"""

import functools

import torch
import torch.nn.functional as F

KERNELS = ("sdpa", "flash_varlen", "npu_fusion")


def _sdpa_padded(q, k, v, scale):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2)


def _sdpa_packed(q, k, v, cu_seqlens, max_seqlen, scale):
    bounds = cu_seqlens.tolist()
    outputs = [
        _sdpa_padded(q[None, start:end], k[None, start:end], v[None, start:end], scale)[0]
        for start, end in zip(bounds[:-1], bounds[1:])
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


def _flash_packed(q, k, v, cu_seqlens, max_seqlen, scale):
    if not _half_precision(q):  # flash kernels take fp16 / bf16 only
        return _sdpa_packed(q, k, v, cu_seqlens, max_seqlen, scale)
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
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **options)


# npu_fusion_attention's causal mode (sparse_mode=3) reads a fixed 2048 x 2048 upper-triangular mask
# (True = masked) whatever the sequence lengths; MindSpeed builds the same one.
_NPU_CAUSAL_MASK_SIZE = 2048


@functools.cache
def _npu_causal_mask(device) -> torch.Tensor:
    size = _NPU_CAUSAL_MASK_SIZE
    return torch.ones(size, size, dtype=torch.bool, device=device).triu(1)


# npu_fusion_attention's TND layout takes at most 1024 sequences per call (torch-npu 2.10's documentation); a packed
# micro-batch of more short sequences is attended in several calls.
_NPU_MAX_SEQUENCES = 1024


def _npu_packed(q, k, v, cu_seqlens, max_seqlen, scale):
    import torch_npu

    bounds = cu_seqlens.tolist()
    outputs = []
    for first in range(0, len(bounds) - 1, _NPU_MAX_SEQUENCES):
        part = bounds[first : first + _NPU_MAX_SEQUENCES + 1]
        start, end = part[0], part[-1]
        ends = [bound - start for bound in part[1:]]  # the TND layout takes cumulative ends as host lists
        outputs.append(torch_npu.npu_fusion_attention(
            q[start:end], k[start:end], v[start:end], q.shape[1],
            input_layout="TND",
            scale=scale,
            keep_prob=1.0,
            sparse_mode=3,
            atten_mask=_npu_causal_mask(q.device),
            actual_seq_qlen=ends,
            actual_seq_kvlen=ends,
        )[0])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _as_packed(packed):
    """A padded-rows entry point made from a packed one: each row becomes one sequence of the full row length."""

    def padded(q, k, v, scale):
        rows, length = q.shape[:2]
        cu_seqlens = torch.arange(0, (rows + 1) * length, length, dtype=torch.int32, device=q.device)
        out = packed(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_seqlens, length, scale)
        return out.view(q.shape[:-1] + (v.shape[-1],))

    return padded


_PADDED = {"sdpa": _sdpa_padded, "flash_varlen": _sdpa_padded, "npu_fusion": _as_packed(_npu_packed)}
_PACKED = {"sdpa": _sdpa_packed, "flash_varlen": _flash_packed, "npu_fusion": _npu_packed}


def check_kernel(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}: choose one of {', '.join(KERNELS)}")


def padded(kernel: str, q, k, v, scale: float):
    """Causal attention over right-padded rows [b, s, heads, d] with `kernel`."""
    return _PADDED[kernel](q, k, v, scale)


def packed(kernel: str, q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    """Causal attention over sequences packed along t ([t, heads, d], boundaries cu_seqlens) with `kernel`."""
    return _PACKED[kernel](q, k, v, cu_seqlens, max_seqlen, scale)
