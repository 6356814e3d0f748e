"""The Qwen3.5 layout kinds (relax/train/model/layouts.py): gated_qkv and Segments put every HF row where
megatron-core's modules read it, and TP sharding / gathering are inverse."""

import torch

from relax.train.model.layouts import AttentionLayout, Rule, Segments, fuse, tp_shard, tp_unshard, unfuse

ATTENTION = AttentionLayout(num_heads=4, num_query_groups=2, head_dim=3)


def _rows(count: int, start: int) -> torch.Tensor:
    return torch.arange(start, start + count, dtype=torch.float32).unsqueeze(1).expand(-1, 5).contiguous()


def test_gated_qkv_puts_queries_then_gates_then_key_and_value_per_group():
    head_dim = ATTENTION.head_dim
    q_and_gate = _rows(2 * 4 * head_dim, 0)  # per head [query | gate]
    k, v = _rows(2 * head_dim, 100), _rows(2 * head_dim, 200)
    whole = fuse("gated_qkv", [q_and_gate, k, v], ATTENTION)
    group0 = whole[: whole.shape[0] // 2, 0].tolist()
    head = lambda h, part: list(range(h * 2 * head_dim + part * head_dim, h * 2 * head_dim + (part + 1) * head_dim))
    assert group0 == head(0, 0) + head(1, 0) + head(0, 1) + head(1, 1) + [100, 101, 102, 200, 201, 202]
    assert all(torch.equal(a, b) for a, b in zip(unfuse("gated_qkv", whole, ATTENTION), [q_and_gate, k, v]))


def test_segments_cut_each_piece_across_tp_ranks_and_gather_back():
    kind = Segments(((4, 4, 6), (6,), (2,), (2,)))
    hf_tensors = [_rows(14, 0), _rows(6, 100), _rows(2, 200), _rows(2, 300)]
    whole = fuse(kind, hf_tensors, ATTENTION)
    shards = [tp_shard(kind, whole, rank, 2) for rank in range(2)]
    assert shards[1][:, 0].tolist() == [2, 3, 6, 7, 11, 12, 13, 103, 104, 105, 201, 301]
    assert torch.equal(tp_unshard(kind, shards), whole)
    assert all(torch.equal(a, b) for a, b in zip(unfuse(kind, whole, ATTENTION), hf_tensors))


def test_a_segments_rule_needs_one_hf_tensor_per_size_group():
    try:
        Rule(Segments(((4, 4, 6), (6,))), ("only_one",))
    except ValueError as error:
        assert "takes 2 HF tensors" in str(error)
    else:
        raise AssertionError("a Segments rule with too few HF names was accepted")


def test_grouped_segments_gather_each_piece_over_the_groups():
    # Qwen3-Next: in_proj_qkvz holds per key head [q (1) | k (1) | v (2) | z (2)], in_proj_ba [b (1) | a (1)]
    kind = Segments(((1, 1, 2, 2), (1, 1)), groups=2)
    qkvz, ba = _rows(12, 0), _rows(4, 100)
    whole = fuse(kind, [qkvz, ba], ATTENTION)
    assert whole[:, 0].tolist() == [0, 6, 1, 7, 2, 3, 8, 9, 4, 5, 10, 11, 100, 102, 101, 103]
    assert all(torch.equal(a, b) for a, b in zip(unfuse(kind, whole, ATTENTION), [qkvz, ba]))
    shards = [tp_shard(kind, whole, rank, 2) for rank in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 2, 3, 4, 5, 100, 101]  # key head 0 with its value heads
    assert torch.equal(tp_unshard(kind, shards), whole)
