"""Hybrid GDN models refuse micro-batch rows that pack several sequences: megatron-core 0.16.1's GatedDeltaNet
ignores the attention mask, so packing would carry the recurrent state from one sequence into the next."""

import pytest
import torch

from relax.train.batch import RolloutBatch, make_micro_batches
from relax.train.model.gdn_spec import refuse_packed_rows

BATCH = RolloutBatch(tokens=[torch.arange(5), torch.arange(3), torch.arange(7)], response_lengths=[2, 1, 3])


def test_one_padded_sequence_per_row_passes():
    # unpacked micro-batches carry no mask (the attention's causal one is exact), so GDN has nothing to refuse
    assert all(mb.attention_mask is None for mb in make_micro_batches(BATCH, micro_batch_size=3))
    allowed = torch.ones(7, 7, dtype=torch.bool).tril()
    allowed[5:, :] = torch.eye(7, dtype=torch.bool)[5:]  # a causal sequence of 5, then padding that sees itself
    refuse_packed_rows(~allowed.view(1, 1, 7, 7))


def test_rows_packing_several_sequences_are_refused():
    packed = make_micro_batches(BATCH, micro_batch_size=3, max_tokens=16)
    assert packed[0].tokens.shape[0] < len(packed[0].sample_indices), "expected fewer rows than samples (packing)"
    with pytest.raises(ValueError, match="one padded sequence per row"):
        for micro_batch in packed:
            refuse_packed_rows(micro_batch.attention_mask)
