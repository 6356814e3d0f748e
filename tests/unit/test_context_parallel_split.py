"""relax.train.context_parallel's head-tail split of a packed row over CP ranks, on one process: which tokens each rank
holds, and that each rank's queries attending to their chunks' keys (relax.platform.attention.packed_with_keys) give
that rank's part of the whole row's causal attention. The gather over the CP group is done here by indexing; the
CPU test of the actor over gloo ranks is tests/e2e/test_train_megatron.py's."""

import pytest
import torch

from helpers import gdn_rows_split_over_ranks
from relax.platform import attention
from relax.train.context_parallel import split_row


def _cu_seqlens(lengths):
    return [0, *torch.tensor(lengths).cumsum(0).tolist()]


def test_rank_r_holds_chunks_r_and_2cp_minus_1_minus_r_of_every_sequence():
    # sequences of 4 and 8 tokens at CP=2: chunks of 1 and 2 tokens
    first, second = (split_row([0, 4, 12], 2, rank, None, "cpu") for rank in range(2))
    assert first.token_index.tolist() == [0, 3, 4, 5, 10, 11]
    assert second.token_index.tolist() == [1, 2, 6, 7, 8, 9]
    assert first.query_cu_seqlens.tolist() == [0, 1, 2, 4, 6] and first.max_query_len == 2
    # each chunk's keys run from its sequence's start to the chunk's end: chunks 0, 3 of 1 token, 0, 3 of 2 tokens
    assert first.key_cu_seqlens.tolist() == [0, 1, 5, 7, 15] and first.max_key_len == 8
    assert second.key_cu_seqlens.tolist() == [0, 2, 5, 9, 15]
    gathered = torch.cat([first.token_index, second.token_index])
    assert gathered[first.gathered_order].tolist() == list(range(12))
    assert gathered[first.key_index].tolist() == [0, 0, 1, 2, 3, 4, 5, 4, 5, 6, 7, 8, 9, 10, 11]


def test_a_sequence_that_does_not_split_into_equal_chunks_is_refused():
    with pytest.raises(ValueError, match="6 tokens does not split into 2 x 2 equal chunks.*sequence_multiple=4"):
        split_row([0, 4, 10], 2, 0, None, "cpu")


@pytest.mark.parametrize("size, lengths", [(2, [4, 12, 8]), (3, [6, 18, 12])])
def test_each_ranks_attention_is_its_part_of_the_whole_rows(size, lengths):
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, 8, generator=generator) for heads in (4, 2, 2))
    cu_seqlens = _cu_seqlens(lengths)
    whole = attention.packed("sdpa", q, k, v, torch.tensor(cu_seqlens, dtype=torch.int32), max(lengths), 0.3)
    splits = [split_row(cu_seqlens, size, rank, None, "cpu") for rank in range(size)]
    gathered_rows = torch.cat([split.token_index for split in splits])  # the all-gather, in rank order
    for split in splits:
        out = attention.packed_with_keys(
            "sdpa", q[split.token_index], k[gathered_rows][split.key_index], v[gathered_rows][split.key_index],
            split.query_cu_seqlens, split.key_cu_seqlens, split.max_query_len, split.max_key_len, 0.3,
        )
        torch.testing.assert_close(out, whole[split.token_index], atol=1e-5, rtol=1e-5)


# Sequences of 4 tokens at CP=2 and 6 at CP=3 have chunks of one token: the convolution's 3 tokens before such a chunk
# come from three chunks on as many ranks
@pytest.mark.parametrize("size, lengths", [(2, [4, 12, 8]), (3, [6, 18, 12])])
def test_gdn_chunks_passing_state_give_each_ranks_part_of_the_whole_rows(size, lengths):
    from relax.kernels.gdn_reference import chunk_gated_delta_rule

    def rule(*args, **kwargs):  # chunks of 4 tokens: several per CP chunk, and a state carried between them
        return chunk_gated_delta_rule(*args, **kwargs, chunk_size=4)

    for name, split, whole in gdn_rows_split_over_ranks(size, lengths, rule):
        torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5, msg=name)
