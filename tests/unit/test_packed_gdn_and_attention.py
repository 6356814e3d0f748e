"""Packed rows without masks: the GDN layer's causal conv restarts at every sequence boundary
(relax.train.model.gdn_spec), and each platform kernel's causal attention (relax.platform.attention) keeps every
sequence to itself and equals plain softmax attention with grouped-query heads."""

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from relax.platform import attention
from relax.train.model.gdn_spec import packed_causal_conv1d, positions_in_sequence, sequence_boundaries

LENGTHS = [5, 1, 9, 3]


def _cu_seqlens(lengths):
    return torch.tensor([0] + lengths).cumsum(0).to(torch.int32)


def test_positions_restart_at_each_sequence():
    positions = positions_in_sequence(_cu_seqlens([3, 1, 2]), 6)
    assert positions.tolist() == [0, 1, 2, 0, 0, 1]
    # without packed rows each of the rows is one sequence
    assert sequence_boundaries(None, rows=3, length=4, device="cpu").tolist() == [0, 4, 8, 12]


def test_packed_conv_equals_each_sequence_convolved_alone():
    generator = torch.Generator().manual_seed(0)
    dim, width = 6, 4
    x = torch.randn(sum(LENGTHS), dim, generator=generator)
    weight, bias = torch.randn(dim, width, generator=generator), torch.randn(dim, generator=generator)
    cu_seqlens = _cu_seqlens(LENGTHS)
    packed = packed_causal_conv1d(x, weight, bias, positions_in_sequence(cu_seqlens, x.shape[0]))
    # nn.Conv1d with padding width-1 as megatron's GatedDeltaNet runs it, one sequence at a time
    expected = [
        F.conv1d(x[s:e].T[None], weight[:, None], bias, padding=width - 1, groups=dim)[0, :, : e - s].T
        for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())
    ]
    torch.testing.assert_close(packed, torch.cat(expected), atol=1e-6, rtol=1e-6)


def _reference_attention(q, k, v, scale):
    """Causal softmax attention of one sequence [s, heads, d], key/value heads repeated to the query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def _qkv(tokens, generator):
    return (torch.randn(tokens, 4, 8, generator=generator), torch.randn(tokens, 2, 8, generator=generator),
            torch.randn(tokens, 2, 8, generator=generator))


@pytest.mark.parametrize("kernel", ["sdpa", "flash_varlen"])  # flash_varlen takes the sdpa path in float32
def test_packed_attention_keeps_sequences_apart(kernel):
    q, k, v = _qkv(sum(LENGTHS), torch.Generator().manual_seed(1))
    cu_seqlens = _cu_seqlens(LENGTHS)
    out = attention.packed(kernel, q, k, v, cu_seqlens, max(LENGTHS), scale=0.3)
    bounds = cu_seqlens.tolist()
    expected = torch.cat([_reference_attention(q[s:e], k[s:e], v[s:e], 0.3) for s, e in zip(bounds, bounds[1:])])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_padded_rows_are_causal_without_a_mask():
    q, k, v = (t.view(2, 6, *t.shape[1:]) for t in _qkv(12, torch.Generator().manual_seed(2)))
    out = attention.padded("sdpa", q, k, v, scale=0.25)
    for row in range(2):
        torch.testing.assert_close(out[row], _reference_attention(q[row], k[row], v[row], 0.25), atol=1e-5, rtol=1e-5)


def test_npu_kernel_passes_tnd_layout_and_causal_mode(monkeypatch):
    """torch_npu is absent here: a test double records the call and answers with the reference, so the packed
    and padded entry points are checked for what they hand the NPU kernel (not for what the NPU computes)."""
    calls = []

    def npu_fusion_attention(q, k, v, head_num, **kwargs):
        calls.append(dict(head_num=head_num, shapes=(q.shape, k.shape), **kwargs))
        ends = [0] + kwargs["actual_seq_qlen"]
        out = torch.cat([_reference_attention(q[s:e], k[s:e], v[s:e], kwargs["scale"]) for s, e in zip(ends, ends[1:])])
        return out, None, None, None

    monkeypatch.setitem(sys.modules, "torch_npu", types.SimpleNamespace(npu_fusion_attention=npu_fusion_attention))
    q, k, v = _qkv(sum(LENGTHS), torch.Generator().manual_seed(3))
    out = attention.packed("npu_fusion", q, k, v, _cu_seqlens(LENGTHS), max(LENGTHS), scale=0.5)
    call = calls[-1]
    assert call["input_layout"] == "TND" and call["sparse_mode"] == 3 and call["keep_prob"] == 1.0
    assert call["head_num"] == 4 and call["scale"] == 0.5
    assert call["actual_seq_qlen"] == call["actual_seq_kvlen"] == [5, 6, 15, 18]  # cumulative ends, host ints
    assert call["atten_mask"].shape == (2048, 2048) and call["atten_mask"][0, 1] and not call["atten_mask"][1, 0]
    assert out.shape == q.shape
    padded = attention.padded("npu_fusion", q[:12].view(2, 6, 4, 8), k[:12].view(2, 6, 2, 8), v[:12].view(2, 6, 2, 8), 0.5)
    assert calls[-1]["actual_seq_qlen"] == [6, 12] and padded.shape == (2, 6, 4, 8)


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        attention.check_kernel("flash")


@pytest.mark.parametrize("newer", [False, True])
def test_flash_kernel_speaks_each_torch_releases_varlen_keywords(monkeypatch, newer):
    """torch's varlen_attn is CUDA-only; a test double with the keywords of torch 2.11 (is_causal, no scale, no
    enable_gqa) or of 2.13 (window_size, scale, enable_gqa) checks what the kernel hands it (bf16, grouped heads)."""
    from torch.nn.attention import varlen

    calls = []
    if newer:
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
            calls.append(dict(k_heads=k.shape[1], scale=scale, window_size=window_size, enable_gqa=enable_gqa))
            return q
    else:
        def varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            calls.append(dict(k_heads=k.shape[1], is_causal=is_causal))
            return q
    monkeypatch.setattr(varlen, "varlen_attn", varlen_attn)
    attention._varlen_parameters.cache_clear()
    try:
        q, k, v = (t.bfloat16() for t in _qkv(sum(LENGTHS), torch.Generator().manual_seed(4)))
        attention.packed("flash_varlen", q, k, v, _cu_seqlens(LENGTHS), max(LENGTHS), scale=8**-0.5)
        if newer:
            assert calls == [dict(k_heads=2, scale=8**-0.5, window_size=(-1, 0), enable_gqa=True)]
        else:
            assert calls == [dict(k_heads=4, is_causal=True)]  # key/value heads repeated to the 4 query heads
            with pytest.raises(ValueError, match="no scale argument"):
                attention.packed("flash_varlen", q, k, v, _cu_seqlens(LENGTHS), max(LENGTHS), scale=0.3)
    finally:
        attention._varlen_parameters.cache_clear()
