"""relax.train.batch: cutting rollout samples into padded or packed micro-batches."""

import pytest
import torch

from relax.train.batch import RolloutBatch, make_micro_batches


def _batch():
    # three samples of 5, 4 and 3 tokens with responses of 2, 1 and 2 tokens
    return RolloutBatch([[1, 2, 3, 4, 5], [6, 7, 8, 9], [10, 11, 12]], [2, 1, 2])


def test_padded_rows_without_budget():
    first, second = make_micro_batches(_batch(), micro_batch_size=2, pad_token_id=0)
    assert first.tokens.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert first.sample_indices == [0, 1] and second.sample_indices == [2]
    # the logit at position p predicts token p + 1: sample 0's response (4, 5) is read at positions 2, 3
    assert first.spans == [(0, 2, 2), (1, 2, 1)]
    positions = torch.arange(10).view(2, 5)
    assert [v.tolist() for v in first.response_values(positions)] == [[2, 3], [7]]
    # one sequence per row, padding after it: the attention's own causal mask is exact, so no mask is built
    assert first.attention_mask is None and second.attention_mask is None


def test_packing_by_token_budget_resets_positions_and_blocks_attention():
    first, second = make_micro_batches(_batch(), micro_batch_size=1, max_tokens=9)
    assert first.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]] and first.sample_indices == [0, 1]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert first.spans == [(0, 2, 2), (0, 7, 1)]
    mask = first.attention_mask[0, 0]
    assert mask[5, 4] and not mask[5, 5] and not mask[8, 5]  # sample 1 cannot see sample 0
    assert not mask[2, 2] and mask[2, 3]  # causal within a sequence
    assert second.tokens.tolist() == [[10, 11, 12]] and second.attention_mask is None  # one sequence in its row


def test_uniform_shape_pads_every_micro_batch_alike_and_adds_empty_ones():
    micro_batches = make_micro_batches(_batch(), micro_batch_size=2, uniform_shape=(3, 2, 6))
    assert [tuple(mb.tokens.shape) for mb in micro_batches] == [(2, 6)] * 3
    assert [mb.sample_indices for mb in micro_batches] == [[0, 1], [2], []]
    with pytest.raises(ValueError, match="smaller"):
        make_micro_batches(_batch(), micro_batch_size=2, uniform_shape=(1, 2, 6))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch=4"):
        make_micro_batches(_batch(), micro_batch_size=1, max_tokens=4)
    with pytest.raises(ValueError, match="sample 0"):
        RolloutBatch([[1, 2]], [2])
    with pytest.raises(ValueError, match=r"advantages\[0\]"):
        RolloutBatch([[1, 2, 3]], [2], advantages=[[1.0]])
