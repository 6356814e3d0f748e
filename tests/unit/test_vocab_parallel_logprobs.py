"""The actor's logprobs and entropy (relax.train.logprobs), computed a few positions at a time, against torch's
log_softmax over the whole vocabulary: values and gradients, float32 and bfloat16 logits, with a temperature, and
over a vocabulary split across tensor-parallel ranks simulated as threads of this process (the values and the
gradient each rank gets for its shard must be those of the whole vocabulary on one rank)."""

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from relax.train import logprobs as chunked
from relax.train.logprobs import logprobs_and_entropy, output_logprobs_and_entropy


class SimulatedTensorParallel:
    """In-place all-reduces (sum and max) between `size` threads."""

    def __init__(self, size: int):
        self.barrier = threading.Barrier(size, timeout=30)
        self.slots = [None] * size

    def _every_rank(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = tensor.detach().clone()
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return values

    def all_reduce(self, rank: int, tensor: torch.Tensor, op: torch.distributed.ReduceOp) -> None:
        every_rank = torch.stack(self._every_rank(rank, tensor))
        tensor.copy_(every_rank.amax(0) if op == torch.distributed.ReduceOp.MAX else every_rank.sum(0))


def sharded_gradients(logits, labels, ranks, objective, temperature=1.0, launch=None):
    """Each simulated rank computes objective(logprobs, entropy) from its shard and backpropagates; returns the
    (logprobs, entropy) of rank 0 and the logits' gradient, the shards' gradients put together. With a launch record,
    through the fused Triton kernels."""
    tp = SimulatedTensorParallel(ranks)
    shards = [shard.clone().requires_grad_() for shard in logits.chunk(ranks, dim=-1)]

    def rank_step(rank):
        logprobs, entropy = logprobs_and_entropy(
            shards[rank].clone(),  # the backward writes the gradient into its logits
            labels,
            temperature,
            vocab_start=rank * shards[rank].shape[-1],
            all_reduce=lambda tensor, op: tp.all_reduce(rank, tensor, op),
            launch=launch,
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


def whole_vocabulary(logits, labels, objective, temperature=1.0):
    """torch's log_softmax over the whole vocabulary in float32: (logprobs, entropy) and the logits' gradient."""
    whole = logits.float().requires_grad_()
    log_p = torch.log_softmax(whole / temperature, dim=-1)
    logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    objective(logprobs, entropy).backward()
    return (logprobs.detach(), entropy.detach()), whole.grad


def weighted(generator, shape):
    """objective(logprobs, entropy): a random mix of the two, as the loss's policy and entropy terms are."""
    logprob_weights, entropy_weights = torch.randn(2, *shape, generator=generator)

    def objective(logprobs, entropy):
        return (logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()

    return objective


def logprobs_only(logprobs, entropy):  # the entropy gets no gradient (the loss without --entropy-coef)
    return (logprobs * torch.arange(logprobs.numel()).view(logprobs.shape)).sum()


@pytest.mark.parametrize("objective_name", ["weighted", "logprobs_only", "entropy_only"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_values_and_gradients_equal_the_whole_vocabulary(ranks, dtype, temperature, objective_name, monkeypatch):
    # 4 positions a piece on one rank's 16 tokens, 8 on two ranks', 16 on four ranks': 3, 2 and 1 pieces
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * 16 * 4)
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(1, 9, 16, generator=generator)).to(dtype)
    labels = torch.tensor([[0, 5, 8, 13, 15, 4, 4, 11, 2]])
    objective = {"weighted": weighted(generator, (1, 9)), "logprobs_only": logprobs_only,
                 "entropy_only": entropy_only}[objective_name]

    (logprobs, entropy), grad = sharded_gradients(logits, labels, ranks, objective, temperature)
    (expected_logprobs, expected_entropy), expected_grad = whole_vocabulary(logits, labels, objective, temperature)
    assert logprobs.dtype == entropy.dtype == torch.float32 and grad.dtype == dtype
    # The same bfloat16 logits go in on both sides and both compute in float32: only the gradient is rounded.
    torch.testing.assert_close(logprobs, expected_logprobs)
    torch.testing.assert_close(entropy, expected_entropy)
    torch.testing.assert_close(grad, expected_grad.to(dtype))


def test_without_a_backward_the_logits_stay_as_they_were():
    logits = torch.randn(6, 16)
    given = logits.clone()
    with torch.no_grad():
        logprobs_and_entropy(logits, torch.arange(6), 0.5)
    assert torch.equal(logits, given)


def test_the_backward_overwrites_the_logits_with_their_gradient():
    # the documented contract that keeps a single [positions, vocab] buffer through the backward
    logits = torch.randn(6, 16)
    source = logits.clone().requires_grad_()
    passed = source * 1.0  # what the model hands over: a non-leaf tensor
    logprobs, _ = logprobs_and_entropy(passed, torch.arange(6))
    logprobs.sum().backward()
    assert torch.equal(passed.detach(), source.grad)


def test_a_temperature_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="temperature must be positive"):
        logprobs_and_entropy(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), 0.0)


def fused_gradients(hidden, weight, labels, ranks, objective, temperature, launch=None):
    """output_logprobs_and_entropy on `ranks` simulated ranks, each with its rows of the weight: rank 0's (logprobs,
    entropy), the hidden states' gradient (the ranks' parts added up) and the weight's (the ranks' rows together).
    With a launch record, through the Triton kernels."""
    tp = SimulatedTensorParallel(ranks)
    shards = [shard.clone().requires_grad_() for shard in weight.chunk(ranks, dim=0)]
    inputs = [hidden.clone().requires_grad_() for _ in range(ranks)]

    def rank_step(rank):
        logprobs, entropy = output_logprobs_and_entropy(
            inputs[rank], shards[rank], labels, temperature, vocab_start=rank * shards[rank].shape[0],
            all_reduce=lambda tensor, op: tp.all_reduce(rank, tensor, op), launch=launch,
        )
        objective(logprobs, entropy).backward()
        return logprobs.detach(), entropy.detach()

    with ThreadPoolExecutor(ranks) as pool:
        results = list(pool.map(rank_step, range(ranks)))
    return results[0], sum(x.grad for x in inputs), torch.cat([shard.grad for shard in shards])


@pytest.mark.parametrize("objective_name", ["weighted", "logprobs_only"])
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_output_projection_fused_with_the_logprobs_equals_logits_then_logprobs(ranks, objective_name,
                                                                                    monkeypatch):
    # 9 positions, a vocabulary of 16 and hidden states of 8, float32. Pieces of 2 positions forward (4 on two
    # ranks) and of 3 vocabulary columns backward (the last one shorter), so the statistics and the
    # gradients are put together from several pieces.
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 4 * 16 * 2)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(9, 8, generator=generator)
    weight = torch.randn(16, 8, generator=generator)
    labels = torch.tensor([0, 5, 8, 13, 15, 4, 4, 11, 2])
    objective = {"weighted": weighted(generator, (9,)), "logprobs_only": logprobs_only}[objective_name]

    (logprobs, entropy), hidden_grad, weight_grad = fused_gradients(hidden, weight, labels, ranks, objective, 0.7)

    hidden_ref, weight_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    expected_logprobs, expected_entropy = logprobs_and_entropy(hidden_ref @ weight_ref.T, labels, 0.7)
    objective(expected_logprobs, expected_entropy).backward()
    torch.testing.assert_close(logprobs, expected_logprobs.detach())
    torch.testing.assert_close(entropy, expected_entropy.detach())
    torch.testing.assert_close(hidden_grad, hidden_ref.grad)
    torch.testing.assert_close(weight_grad, weight_ref.grad)


def test_the_fused_output_in_bfloat16_rounds_like_the_logits_it_replaces():
    # bfloat16 hidden states and weight (a bf16 actor's): the same values as logits computed in bfloat16, and
    # gradients within bfloat16's rounding of them
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 8, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(16, 8, generator=generator).bfloat16().requires_grad_()
    labels = torch.tensor([1, 3, 5, 7, 9, 11])
    logprobs, entropy = output_logprobs_and_entropy(hidden, weight, labels)
    (logprobs.sum() + entropy.sum()).backward()
    assert logprobs.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    hidden_ref, weight_ref = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    expected_logprobs, expected_entropy = logprobs_and_entropy(hidden_ref @ weight_ref.T, labels)
    (expected_logprobs.sum() + expected_entropy.sum()).backward()
    torch.testing.assert_close(logprobs, expected_logprobs.detach())
    torch.testing.assert_close(entropy, expected_entropy.detach())
    torch.testing.assert_close(hidden.grad, hidden_ref.grad)
    torch.testing.assert_close(weight.grad, weight_ref.grad)


def test_mis_shaped_hidden_states_and_weight_are_named():
    with pytest.raises(ValueError, match=r"hidden states \(4, 8\) and output weight \(16, 6\)"):
        output_logprobs_and_entropy(torch.randn(4, 8), torch.randn(16, 6), torch.zeros(4, dtype=torch.long))
