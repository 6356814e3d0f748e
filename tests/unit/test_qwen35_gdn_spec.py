"""Hybrid GDN models refuse micro-batch rows that pack several sequences: megatron-core 0.16.1's GatedDeltaNet
ignores the attention mask, so packing would carry the recurrent state from one sequence into the next."""

import pytest
import torch

from relax.train.batch import RolloutBatch, make_micro_batches
from relax.train.model.gdn_spec import refuse_packed_rows

BATCH = RolloutBatch(tokens=[torch.arange(5), torch.arange(3), torch.arange(7)], response_lengths=[2, 1, 3])


def test_one_padded_sequence_per_row_passes():
    for micro_batch in make_micro_batches(BATCH, micro_batch_size=3):
        refuse_packed_rows(micro_batch.attention_mask)


def test_rows_packing_several_sequences_are_refused():
    packed = make_micro_batches(BATCH, micro_batch_size=3, max_tokens=16)
    assert packed[0].tokens.shape[0] < len(packed[0].sample_indices), "expected fewer rows than samples (packing)"
    with pytest.raises(ValueError, match="one padded sequence per row"):
        for micro_batch in packed:
            refuse_packed_rows(micro_batch.attention_mask)
