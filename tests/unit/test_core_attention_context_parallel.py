"""Which context-parallel attention relax's core attention takes (relax.platform.attention.CONTEXT_PARALLEL_ATTENTION):
the platform's, MindSpeed's ring attention where it takes the row, else relax's all-gather. On one process, with one
CP rank's split (the gathered row is the rank's own) and MindSpeed's ring recorded instead of called; the ring over
gloo ranks is tests/npu/test_mindspeed_ring_attention.py's."""

import dataclasses
import types

import pytest
import torch

from relax.platform import attention
from relax.train.context_parallel import RowSplit, split_row
from relax.train.model.core_attention import CoreAttention

HEADS, HEAD_DIM = 2, 8


class OneRankSplit(RowSplit):
    def attention_keys_and_values(self, keys, values):  # one CP rank: the gathered row is its own tokens
        return keys[self.key_index], values[self.key_index]


def _core_attention(method: str) -> CoreAttention:
    config = types.SimpleNamespace(
        attention_dropout=0.0, window_size=None, context_parallel_size=2, kv_channels=HEAD_DIM
    )
    return CoreAttention(config, 1, None, "self", kernel="sdpa", context_parallel_attention=method)


def _attend(method: str, lengths: list[int]):
    cu_seqlens = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    split = split_row(cu_seqlens, 1, 0, "the CP group", "cpu")
    split = OneRankSplit(**{field.name: getattr(split, field.name) for field in dataclasses.fields(split)})
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(cu_seqlens[-1], HEADS, HEAD_DIM, generator=generator) for _ in range(3))
    out = _core_attention(method)(q, k, v, None, packed_seq_params=types.SimpleNamespace(row_split=split))
    return out, (q, k, v, split)


def test_mindspeeds_ring_attends_a_row_it_takes(monkeypatch):
    calls = []

    def ring(q, k, v, chunk_cu_seqlens, group, scale):
        calls.append((chunk_cu_seqlens.tolist(), group, scale))
        return torch.zeros_like(q)

    monkeypatch.setattr(attention, "mindspeed_ring", ring)
    out, _ = _attend("mindspeed-ring", [4, 2, 6])
    assert out.shape == (12, HEADS * HEAD_DIM) and not out.any()
    assert calls == [([0, 2, 4, 5, 6, 9, 12], "the CP group", pytest.approx(HEAD_DIM**-0.5))]


def test_a_row_of_more_than_1024_samples_takes_relaxs_all_gather(monkeypatch):
    def ring(*args):
        raise AssertionError("MindSpeed's ring attention called for a row of 1025 samples")

    monkeypatch.setattr(attention, "mindspeed_ring", ring)
    lengths = [2] * 1025
    got, _ = _attend("mindspeed-ring", lengths)
    expected, _ = _attend("all-gather", lengths)
    torch.testing.assert_close(got, expected)


def test_an_unknown_context_parallel_attention_is_refused():
    with pytest.raises(ValueError, match="unknown context-parallel attention 'ring': choose one of all-gather, mind"):
        _core_attention("ring")
