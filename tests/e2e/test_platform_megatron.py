"""megatron-core 0.16.1 trains on the CPU platform: a real GPTModel (local spec) under Megatron DDP, its
optimizer (plain and distributed) and its schedules (no pipelining; 1F1B with PP=2), on gloo, world size 2."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from relax.ports import free_port

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES, STEPS = 64, 16, 2, 2, 3


def _train(tensor_parallel: int = 1, pipeline_parallel: int = 1, distributed_optimizer: bool = False):
    """Builds a tiny GPT, takes STEPS optimizer steps; returns (losses, flat parameters, grad norms).
    Losses are the mean over micro-batches per step, on the last pipeline stage only."""
    from megatron.core import parallel_state, tensor_parallel as mtp
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel
    )
    mtp.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        add_bias_linear=False,
        hidden_dropout=0.1,  # dropout draws from the redirected RNG tracker
        attention_dropout=0.0,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
    )
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    # Without this the schedule never reduces DP gradients (docs/upstream-facts.md, "megatron-core 0.16.1 on the CPU").
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer),
        [model],
    )

    # Every data-parallel rank reads different tokens; tensor-parallel ranks read the same ones.
    data_rank = parallel_state.get_data_parallel_rank()
    generator = torch.Generator().manual_seed(100 + data_rank)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, -1)

    def forward_step(data_iterator, model):
        output = model(tokens[:, :-1], position_ids, attention_mask=None, labels=tokens[:, 1:])

        def loss_func(per_token_loss):
            loss = per_token_loss.float().mean()
            return loss, {"loss": loss.detach()}

        return output, loss_func

    losses, grad_norms = [], []
    for _ in range(STEPS):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        result = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter([None] * MICRO_BATCHES),
            model=[model],
            num_microbatches=MICRO_BATCHES,
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        update_successful, grad_norm, _ = optimizer.step()
        assert update_successful
        if result:  # the last pipeline stage
            losses.append(sum(r["loss"].item() for r in result) / len(result))
        grad_norms.append(grad_norm)
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    parallel_state.destroy_model_parallel()
    return losses, params, grad_norms


def _worker(rank: int, world_size: int, port: int, results):
    from relax.platform import get_platform

    platform = get_platform("cpu")
    platform.prepare_megatron()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group(platform.dist_backend, rank=rank, world_size=world_size)
    try:
        results[rank] = {
            "dp": _train(),
            "dp_distopt": _train(distributed_optimizer=True),
            "tp": _train(tensor_parallel=2),
            "pp": _train(pipeline_parallel=2),
        }
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(2, free_port(), shared), nprocs=2, join=True)
        return dict(shared)


@pytest.mark.parametrize("run", ["dp", "dp_distopt"])
def test_data_parallel_ranks_train_the_same_weights(results, run):
    (losses0, params0, norms0), (losses1, params1, norms1) = results[0][run], results[1][run]
    assert all(torch.isfinite(torch.tensor(losses0 + losses1)))
    assert losses0 != losses1, "each data-parallel rank should see its own tokens"
    # Gradients were all-reduced over gloo: both ranks took identical optimizer steps.
    torch.testing.assert_close(params0, params1, rtol=0, atol=0)
    assert norms0 == norms1 and all(n > 0 for n in norms0)


def test_training_changes_the_loss(results):
    losses, _, _ = results[0]["dp"]
    assert losses[-1] < losses[0]


def test_tensor_parallel_ranks_agree_on_the_loss(results):
    (losses0, params0, _), (losses1, params1, _) = results[0]["tp"], results[1]["tp"]
    assert losses0 == losses1 and losses0[-1] < losses0[0]
    assert not torch.equal(params0, params1), "each tensor-parallel rank should hold its own shards"


def test_pipeline_stages_train_through_point_to_point_on_gloo(results):
    first_losses, first_params, first_norms = results[0]["pp"]
    last_losses, last_params, last_norms = results[1]["pp"]
    assert first_losses == [] and len(last_losses) == STEPS and last_losses[-1] < last_losses[0]
    # The grad norm is reduced over both stages, so the first stage received gradients from the last.
    assert first_norms == last_norms and all(n > 0 for n in first_norms)
    assert first_params.numel() != last_params.numel(), "each stage should hold its own layers"
