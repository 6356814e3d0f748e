"""The actor's logprobs and entropy over a vocabulary split across tensor-parallel ranks
(relax.train.actor.sharded_logprobs_and_entropy), with the ranks simulated as threads of this process: the
values and the gradient each rank gets for its shard must be those of the whole vocabulary on one rank."""

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from relax.train.actor import sharded_logprobs_and_entropy


class SimulatedTensorParallel:
    """All-reduces between `size` threads, with Megatron's autograd: the sum's backward hands each rank the
    gradient of the sum for its own tensor (reduce_from_tensor_model_parallel_region)."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size

    def _every_rank(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return values

    def sum(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        total = torch.stack(self._every_rank(rank, tensor)).sum(0)
        return tensor + (total - tensor.detach())  # forward: the total; backward: identity to this rank's tensor

    def max(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._every_rank(rank, tensor)).amax(0)


def sharded_gradients(logits, labels, ranks, objective):
    """Each simulated rank computes objective(logprobs, entropy) from its shard and backpropagates; returns the
    (logprobs, entropy) of rank 0 and the logits' gradient, the shards' gradients put together."""
    tp = SimulatedTensorParallel(ranks)
    shards = [shard.clone().requires_grad_() for shard in logits.chunk(ranks, dim=-1)]

    def rank_step(rank):
        logprobs, entropy = sharded_logprobs_and_entropy(
            shards[rank],
            labels,
            vocab_start=rank * shards[rank].shape[-1],
            sum_over_shards=lambda t: tp.sum(rank, t),
            max_over_shards=lambda t: tp.max(rank, t),
        )
        objective(logprobs, entropy).backward()
        return logprobs.detach(), entropy.detach()

    with ThreadPoolExecutor(ranks) as pool:
        results = list(pool.map(rank_step, range(ranks)))
    return results[0], torch.cat([shard.grad for shard in shards], dim=-1)


def entropy_only(logprobs, entropy):
    return entropy.sum()


def test_entropy_gradient_by_hand_over_two_ranks():
    # p = (1/6, 1/6, 1/6, 1/2): H = ln 12 / 2 and dH/dx_v = -p_v (log p_v + H) = ln 3 / 12 for the first three
    # tokens and -ln 3 / 4 for the last. Rank 1 holds tokens 2 and 3, rank 0 tokens 0 and 1: rank 0's gradient
    # comes only through Z, whose gradient needs rank 1's terms.
    logits = torch.tensor([[0.0, 0.0, 0.0, math.log(3.0)]])
    (logprobs, entropy), grad = sharded_gradients(logits, torch.tensor([3]), 2, entropy_only)
    assert entropy.tolist() == pytest.approx([math.log(12.0) / 2], rel=1e-6)
    assert logprobs.tolist() == pytest.approx([math.log(0.5)], rel=1e-6)
    ln3 = math.log(3.0)
    assert grad[0].tolist() == pytest.approx([ln3 / 12, ln3 / 12, ln3 / 12, -ln3 / 4], rel=1e-5)


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_sharded_values_and_gradients_equal_the_whole_vocabulary(ranks):
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(5, 16, generator=generator)
    labels = torch.tensor([0, 5, 8, 13, 15])
    logprob_weights, entropy_weights = torch.randn(2, 5, generator=generator)

    def objective(logprobs, entropy):
        return (logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()

    (logprobs, entropy), grad = sharded_gradients(logits, labels, ranks, objective)

    whole = logits.clone().requires_grad_()
    log_p = torch.log_softmax(whole, dim=-1)
    expected_logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(log_p.exp() * log_p).sum(-1)
    objective(expected_logprobs, expected_entropy).backward()
    torch.testing.assert_close(logprobs, expected_logprobs.detach())
    torch.testing.assert_close(entropy, expected_entropy.detach())
    torch.testing.assert_close(grad, whole.grad)
