"""relax.train.batch: spreading a rollout over data-parallel ranks by tokens, and packing each rank's samples into
THD micro-batches (one row, sequence boundaries in cu_seqlens, no mask)."""

import pytest
import torch

from relax.train.batch import (
    RolloutBatch, balanced_shares, make_micro_batches, optimizer_step_sizes, plan_micro_batches,
    split_over_data_parallel, token_imbalance,
)


def _batch():
    # three samples of 5, 4 and 3 tokens with responses of 2, 1 and 2 tokens
    return RolloutBatch([[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12]], [2, 1, 2])


def test_samples_pack_into_one_row_with_their_boundaries():
    first, second = make_micro_batches(_batch(), micro_batch_size=2)
    assert first.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]] and first.sample_indices == [0, 1]
    assert first.cu_seqlens.tolist() == [0, 5, 9] and first.cu_seqlens.dtype == torch.int32
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]  # positions restart at each sequence
    assert first.max_seqlen == 5
    # the logit at position p predicts token p + 1: sample 0's response (4, 5) is read at positions 2, 3
    assert first.spans == [(2, 2), (7, 1)]
    positions = torch.arange(9).view(1, 9)
    assert [v.tolist() for v in first.response_values(positions)] == [[2, 3], [7]]
    assert second.tokens.tolist() == [[10, 11, 12]] and second.cu_seqlens.tolist() == [0, 3]
    params = first.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_kv is first.cu_seqlens and params.max_seqlen_kv == 5


def test_token_budget_packs_longest_first_into_fewest_micro_batches():
    # 7, 2, 6, 3 tokens under a budget of 9: in rollout order 7 | 2+6 | 3 would take three; longest first two
    counts = [7, 2, 6, 3]
    assert plan_micro_batches(counts, micro_batch_size=1, max_tokens=9) == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="7 tokens, more than the 6 tokens.*--max-tokens-per-device"):
        plan_micro_batches(counts, micro_batch_size=1, max_tokens=6)


def test_padding_is_a_sequence_of_its_own_at_the_end():
    (packed,) = make_micro_batches(_batch(), micro_batch_size=3, multiple=8)
    assert packed.num_tokens == 16
    assert packed.cu_seqlens.tolist() == [0, 5, 9, 12, 16] and packed.tokens[0, 12:].tolist() == [0] * 4
    assert packed.position_ids[0, 12:].tolist() == [0, 1, 2, 3] and packed.sample_indices == [0, 1, 2]


def test_context_parallelism_pads_every_sequence_to_a_multiple_of_its_chunks():
    # 5, 4 and 3 tokens, each padded to a multiple of 4 (2 chunks per rank at CP=2): 8, 4, 4
    (packed,) = make_micro_batches(_batch(), micro_batch_size=3, multiple=4, sequence_multiple=4)
    assert packed.cu_seqlens.tolist() == [0, 8, 12, 16] and packed.max_seqlen == 8
    assert packed.tokens.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 8, 9, 10, 11, 12, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 0, 1, 2, 3]]
    assert packed.spans == [(2, 2), (10, 1), (12, 2)]  # responses read where their real tokens are
    # the token budget counts padded lengths: 8 + 4 fill a budget of 12, unpadded all three (12 tokens) would
    assert [mb.sample_indices for mb in make_micro_batches(_batch(), 1, 12, multiple=4, sequence_multiple=4)] == [
        [0, 1], [2]
    ]
    with pytest.raises(ValueError, match="not a multiple of 4"):
        make_micro_batches(_batch(), micro_batch_size=3, multiple=2, sequence_multiple=4)


def test_uniform_shape_pads_every_micro_batch_alike_and_adds_empty_ones():
    micro_batches = make_micro_batches(_batch(), micro_batch_size=2, uniform_shape=(3, 10))
    assert [tuple(mb.tokens.shape) for mb in micro_batches] == [(1, 10)] * 3
    assert [mb.sample_indices for mb in micro_batches] == [[0, 1], [2], []]
    assert micro_batches[2].cu_seqlens.tolist() == [0, 10]  # all padding: one sequence, read by nobody
    with pytest.raises(ValueError, match="smaller"):
        make_micro_batches(_batch(), micro_batch_size=2, uniform_shape=(1, 10))


def test_ranks_get_equal_tokens_not_equal_sample_counts():
    counts = [100, 10, 90, 10, 10, 10, 10, 10, 10, 10, 10, 10]
    shares = balanced_shares(counts, 2)
    totals = [sum(counts[i] for i in share) for share in shares]
    assert totals == [150, 140] and sorted(sum(shares, [])) == list(range(12))
    assert token_imbalance(counts, shares) == pytest.approx(150 / 145)
    # striding by sample count, as a sample-count split would, puts both long samples on one rank
    assert token_imbalance(counts, [list(range(0, 12, 2)), list(range(1, 12, 2))]) == pytest.approx(230 / 145)
    with pytest.raises(ValueError, match="3 samples cannot give each of 4"):
        balanced_shares([1, 2, 3], 4)


def test_each_optimizer_step_is_balanced_on_its_own():
    counts = [8, 1, 1, 1, 5, 5, 1, 1]
    shares, worst = split_over_data_parallel(counts, optimizer_step_sizes(8, 4, 2, global_batch_size=4), num_ranks=2)
    assert [s.step_sizes for s in shares] == [[1, 2], [3, 2]]
    assert [s.indices for s in shares] == [[0, 4, 6], [1, 2, 3, 5, 7]]
    for step in (range(0, 4), range(4, 8)):  # no sample crosses into another optimizer step
        assert sorted(i for s in shares for i in s.indices if i in step) == list(step)
    assert worst == pytest.approx(8 / 5.5)
    with pytest.raises(ValueError, match="not a multiple of the global batch size 3"):
        optimizer_step_sizes(8, 4, 2, global_batch_size=3)


def test_a_rollout_with_fanned_out_groups_takes_as_many_optimizer_steps_each_holding_more_samples():
    # 4 groups of 2 samples nominally (2 steps of 4); fan-out made 11 samples: steps of 5 and 6, in order
    assert optimizer_step_sizes(8, 4, 2, global_batch_size=4) == [4, 4]
    assert optimizer_step_sizes(11, 4, 2, global_batch_size=4) == [5, 6]
    assert optimizer_step_sizes(11, 4, 2, global_batch_size=8) == [11]
    shares, _ = split_over_data_parallel([1] * 11, [5, 6], num_ranks=2)
    assert [s.step_sizes for s in shares] == [[3, 3], [2, 3]]
    assert sorted(i for s in shares for i in s.indices) == list(range(11))
    with pytest.raises(ValueError, match=r"optimizer steps of \[5, 5\] samples for 11 rollout samples"):
        split_over_data_parallel([1] * 11, [5, 5], num_ranks=2)
    with pytest.raises(ValueError, match="7 samples are fewer than 4 groups x 2"):
        optimizer_step_sizes(7, 4, 2, global_batch_size=4)


def test_select_keeps_per_token_fields():
    batch = RolloutBatch([[1, 2, 3], [4, 5]], [2, 1], advantages=[[0.5, 0.25], [1.0]])
    picked = batch.select([1])
    assert picked.tokens[0].tolist() == [4, 5] and picked.advantages[0].tolist() == [1.0]
    assert picked.old_logprobs is None
    assert picked.loss_mask[0].tolist() == [1.0]  # built: every response token trained
    masked = RolloutBatch([[1, 2, 3], [4, 5]], [2, 1], loss_mask=[[1, 0], [1]]).select([0])
    assert masked.loss_mask[0].tolist() == [1.0, 0.0]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="sample 0"):
        RolloutBatch([[1, 2]], [2])
    with pytest.raises(ValueError, match=r"advantages\[0\]"):
        RolloutBatch([[1, 2, 3]], [2], advantages=[[1.0]])
    with pytest.raises(ValueError, match=r"loss_mask\[0\] has shape \(3,\), expected \(2,\)"):
        RolloutBatch([[1, 2, 3]], [2], loss_mask=[[1, 1, 1]])


def _routed(num_tokens: int, first: int) -> torch.Tensor:
    """Distinct experts per token (2 layers, top-2) for every token but the last: row j is first + j."""
    return (first + torch.arange(num_tokens - 1)).view(-1, 1, 1).expand(-1, 2, 2).to(torch.int16)


def test_routed_experts_are_packed_like_the_tokens_with_placeholders_where_nothing_was_recorded():
    batch = _batch()
    batch = RolloutBatch(batch.tokens, batch.response_lengths,
                         routed_experts=[_routed(5, 10), _routed(4, 20), _routed(3, 30)])
    (packed,) = make_micro_batches(batch, micro_batch_size=3, multiple=8)  # 12 tokens and 4 of padding
    assert packed.routed_experts.shape == (16, 2, 2)
    placeholder = [0, 1]  # experts 0 .. top-k - 1: each sequence's last token and the padding
    rows = [[10, 11, 12, 13, "p"], [20, 21, 22, "p"], [30, 31, "p"], ["p"] * 4]
    expected = [placeholder if row == "p" else [row, row] for sequence in rows for row in sequence]
    assert packed.routed_experts[:, 0].tolist() == expected and packed.routed_experts[:, 1].tolist() == expected
    # a sample's token at position p of the row has its own experts at p
    start = packed.cu_seqlens[1].item()
    assert packed.routed_experts[start + 2, 0].tolist() == [22, 22]
    assert batch.select([2, 0]).routed_experts[0].tolist() == _routed(3, 30).tolist()
    assert make_micro_batches(_batch(), micro_batch_size=3)[0].routed_experts is None


def test_routed_experts_follow_each_sample_padded_for_context_parallelism():
    batch = _batch()
    batch = RolloutBatch(batch.tokens, batch.response_lengths,
                         routed_experts=[_routed(5, 10), _routed(4, 20), _routed(3, 30)])
    (packed,) = make_micro_batches(batch, micro_batch_size=3, multiple=4, sequence_multiple=4)  # 8, 4 and 4 tokens
    assert packed.cu_seqlens.tolist() == [0, 8, 12, 16]
    rows = [[10, 11, 12, 13, "p", "p", "p", "p"], [20, 21, 22, "p"], [30, 31, "p", "p"]]
    expected = [[0, 1] if row == "p" else [row, row] for sequence in rows for row in sequence]
    assert packed.routed_experts[:, 0].tolist() == expected


def test_routed_experts_must_cover_every_token_but_the_last():
    with pytest.raises(ValueError, match=r"routed_experts\[0\] has shape \(4, 2, 2\), expected \(2, layers, top-k\)"):
        RolloutBatch([[1, 2, 3]], [2], routed_experts=[_routed(5, 0)])
    with pytest.raises(ValueError, match=r"routed_experts\[1\] has \[layers, top-k\] \(2, 1\), sample 0 \(2, 2\)"):
        RolloutBatch([[1, 2, 3], [4, 5]], [2, 1], routed_experts=[_routed(3, 0), torch.zeros(1, 2, 1)])
