"""The actor's logprobs and entropy (relax.train.logprobs through relax.train.actor.vocab_parallel_logprobs) at tensor
parallel size 2 over megatron-core's tensor-parallel group (two gloo ranks on the CPU), a few positions at a time:
the gradient each rank gets for its vocabulary shard is the hand-derived one, and on random float32 and bfloat16
logits the values and gradients are those of the same function at tensor parallel size 1 and of torch's log_softmax
over the whole vocabulary; values computed without a gradient equal the differentiable ones. And the output layer
fused with them (relax.train.actor.vocab_parallel_output_logprobs), with and without sequence parallelism."""

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


def _output_gradients(hidden, weight, labels, logprob_weights, entropy_weights, temperature: float,
                      sequence_parallel: bool):
    """On each rank, the output layer fused with the logprobs (actor.vocab_parallel_output_logprobs) on its half of
    the output weight's rows and, under sequence parallelism, its half of the positions (else all of them), in
    pieces of 2 positions: (logprobs, entropy, d objective / d its hidden states, d objective / d its weight rows)."""
    from megatron.core import parallel_state

    from relax.train import actor, logprobs as chunked

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    rank = parallel_state.get_tensor_model_parallel_rank()
    chunked.CHUNK_BYTES = 4 * weight.shape[0] // TP * 2
    local_hidden = (hidden.chunk(TP, dim=1)[rank] if sequence_parallel else hidden).clone().requires_grad_()
    local_weight = weight.chunk(TP, dim=0)[rank].clone().requires_grad_()
    logprobs, entropy = actor.vocab_parallel_output_logprobs(local_hidden, local_weight, labels, sequence_parallel,
                                                            temperature)
    ((logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()).backward()
    return logprobs.detach(), entropy.detach(), local_hidden.grad, local_weight.grad


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tensor-parallel", "sequence-parallel"])
def test_the_output_layer_fused_at_tp2_equals_the_whole_logits(ranks, sequence_parallel):
    """Through megatron's own mappings as its output layer: the hidden states' gradient all-reduced over the TP ranks,
    or with sequence parallelism their positions all-gathered and the gradient reduce-scattered."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 6, 8, generator=generator)
    weight = torch.randn(16, 8, generator=generator)
    labels = torch.tensor([[0, 3, 7, 8, 12, 15]])
    logprob_weights, entropy_weights = torch.randn(2, 1, 6, generator=generator)
    results = ranks.run(_output_gradients, hidden, weight, labels, logprob_weights, entropy_weights, 0.8,
                        sequence_parallel)

    whole_hidden, whole_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_p = torch.log_softmax(whole_hidden @ whole_weight.T / 0.8, dim=-1)
    logprobs = log_p.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    ((logprob_weights * logprobs).sum() + (entropy_weights * entropy).sum()).backward()
    for rank, (rank_logprobs, rank_entropy, hidden_grad, weight_grad) in enumerate(results):
        torch.testing.assert_close(rank_logprobs, logprobs.detach())
        torch.testing.assert_close(rank_entropy, entropy.detach())
        expected_hidden_grad = whole_hidden.grad.chunk(TP, dim=1)[rank] if sequence_parallel else whole_hidden.grad
        torch.testing.assert_close(hidden_grad, expected_hidden_grad)
        torch.testing.assert_close(weight_grad, whole_weight.grad.chunk(TP, dim=0)[rank])
