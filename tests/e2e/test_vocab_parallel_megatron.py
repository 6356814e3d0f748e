"""The actor's logprobs and entropy (relax.train.logprobs through relax.train.actor.vocab_parallel_logprobs) at tensor
parallel size 2 over megatron-core's tensor-parallel group (two gloo ranks on the CPU), a few positions at a time:
the gradient each rank gets for its vocabulary shard is the hand-derived one, and on random float32 and bfloat16
logits the values and gradients are those of the same function at tensor parallel size 1 and of torch's log_softmax
over the whole vocabulary; values computed without a gradient equal the differentiable ones."""

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


def _shard_gradient(logits, labels, logprob_weights, entropy_weights, temperature: float, tp: int = TP):
    """On each rank: (logprobs, entropy, d objective / d this rank's logits) for its 1/tp of the vocabulary."""
    from megatron.core import parallel_state

    from relax.train import actor, logprobs as chunked

    chunked.CHUNK_BYTES = 4 * logits.shape[-1] * 2  # pieces of 2 positions at TP=1, 4 at TP=2
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = logits.chunk(tp, dim=-1)[rank]
    with torch.no_grad():
        reported_logprobs, reported_entropy = actor.vocab_parallel_logprobs(shard, labels, temperature)
    passed = shard.clone().requires_grad_()
    logprobs, entropy = actor.vocab_parallel_logprobs(passed * 1.0, labels, temperature)
    ((logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()).backward()
    torch.testing.assert_close(reported_entropy, entropy.detach())
    torch.testing.assert_close(reported_logprobs, logprobs.detach())
    return logprobs.detach(), entropy.detach(), passed.grad


def test_entropy_gradient_at_tp2_is_the_hand_derived_one(ranks):
    # p = (1/6, 1/6, 1/6, 1/2): H = ln 12 / 2, dH/dx_v = -p_v (log p_v + H) = ln 3 / 12, ln 3 / 12 | ln 3 / 12,
    # -ln 3 / 4 (rank 0 holds tokens 0 and 1, rank 1 tokens 2 and 3)
    logits = torch.tensor([[0.0, 0.0, 0.0, math.log(3.0)]])
    results = ranks.run(_shard_gradient, logits, torch.tensor([3]), torch.zeros(1), torch.ones(1), 1.0)
    ln3 = math.log(3.0)
    for _, entropy, _ in results:
        assert entropy.tolist() == pytest.approx([math.log(12.0) / 2], rel=1e-6)
    gradient = torch.cat([grad for _, _, grad in results], dim=-1)
    assert gradient[0].tolist() == pytest.approx([ln3 / 12, ln3 / 12, ln3 / 12, -ln3 / 4], rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tp2_values_and_gradients_equal_tp1_and_the_whole_vocabulary(ranks, dtype):
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(1, 7, 16, generator=generator)).to(dtype)
    labels = torch.tensor([[0, 3, 7, 8, 12, 15, 9]])
    logprob_weights, entropy_weights = torch.randn(2, 1, 7, generator=generator)
    temperature = 0.8
    results = ranks.run(_shard_gradient, logits, labels, logprob_weights, entropy_weights, temperature)
    (tp1_logprobs, tp1_entropy, tp1_grad), _ = ranks.run(
        _shard_gradient, logits, labels, logprob_weights, entropy_weights, temperature, 1
    )

    whole = logits.float().requires_grad_()
    log_p = torch.log_softmax(whole / temperature, dim=-1)
    logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()).backward()
    torch.testing.assert_close(tp1_logprobs, logprobs.detach())
    torch.testing.assert_close(tp1_entropy, entropy.detach())
    torch.testing.assert_close(tp1_grad, whole.grad.to(dtype))
    tp2_grad = torch.cat([grad for _, _, grad in results], dim=-1)
    assert tp2_grad.dtype == dtype
    for rank_logprobs, rank_entropy, _ in results:
        torch.testing.assert_close(rank_logprobs, tp1_logprobs)
        torch.testing.assert_close(rank_entropy, tp1_entropy)
    torch.testing.assert_close(tp2_grad, tp1_grad)
