"""The actor's logprobs and entropy at tensor parallel size 2 through megatron-core's own all-reduces (two gloo
ranks on the CPU): the gradient each rank gets for its vocabulary shard is the hand-derived one, and on random
logits that of the whole vocabulary on one rank; the entropy reported without a gradient (computed a few positions
at a time, before megatron's cross entropy overwrites the logits) equals the differentiable one."""

import math

import pytest
import torch

from spawned_ranks import SpawnedRanks

TP = 2


@pytest.fixture(scope="module")
def ranks():
    pool = SpawnedRanks(TP, task_timeout_s=120)
    yield pool
    pool.close()


def _shard_gradient(logits: torch.Tensor, labels: torch.Tensor, logprob_weights, entropy_weights):
    """On each rank: (logprobs, entropy, d objective / d this rank's logits) for its half of the vocabulary."""
    from megatron.core import parallel_state

    from relax.train import actor

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = logits.chunk(TP, dim=-1)[rank].clone().requires_grad_()
    logprobs, entropy = actor.vocab_parallel_logprobs(shard, labels, with_entropy=True, entropy_grad=True)
    ((logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()).backward()

    actor.ENTROPY_CHUNK = 4  # several pieces on these few positions
    reported_logprobs, reported_entropy = actor.vocab_parallel_logprobs(shard.detach().clone(), labels, True)
    assert not reported_entropy.requires_grad
    torch.testing.assert_close(reported_entropy, entropy.detach())
    torch.testing.assert_close(reported_logprobs, logprobs.detach())
    return logprobs.detach(), entropy.detach(), shard.grad


def test_entropy_gradient_at_tp2_is_the_hand_derived_one(ranks):
    # p = (1/6, 1/6, 1/6, 1/2): H = ln 12 / 2, dH/dx_v = -p_v (log p_v + H) = ln 3 / 12, ln 3 / 12 | ln 3 / 12,
    # -ln 3 / 4 (rank 0 holds tokens 0 and 1, rank 1 tokens 2 and 3)
    logits = torch.tensor([[0.0, 0.0, 0.0, math.log(3.0)]])
    results = ranks.run(_shard_gradient, logits, torch.tensor([3]), torch.zeros(1), torch.ones(1))
    ln3 = math.log(3.0)
    for _, entropy, _ in results:
        assert entropy.tolist() == pytest.approx([math.log(12.0) / 2], rel=1e-6)
    gradient = torch.cat([grad for _, _, grad in results], dim=-1)
    assert gradient[0].tolist() == pytest.approx([ln3 / 12, ln3 / 12, ln3 / 12, -ln3 / 4], rel=1e-5)


def test_tp2_values_and_gradients_equal_the_whole_vocabulary(ranks):
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 16, generator=generator)
    labels = torch.tensor([0, 3, 7, 8, 12, 15])
    logprob_weights, entropy_weights = torch.randn(2, 6, generator=generator)
    results = ranks.run(_shard_gradient, logits, labels, logprob_weights, entropy_weights)

    whole = logits.clone().requires_grad_()
    log_p = torch.log_softmax(whole, dim=-1)
    logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()).backward()
    for rank_logprobs, rank_entropy, _ in results:
        torch.testing.assert_close(rank_logprobs, logprobs.detach())
        torch.testing.assert_close(rank_entropy, entropy.detach())
    torch.testing.assert_close(torch.cat([grad for _, _, grad in results], dim=-1), whole.grad)
