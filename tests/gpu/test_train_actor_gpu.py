"""The Megatron actor on a CUDA GPU (one process, world size 1): logprobs equal HF's on the device, and
sleep hands the training state's device memory back and wake restores it bit for bit, so training goes on
exactly as if the actor had never slept; also with bf16 parameters (Float16Module, fp32 main params).
Skipped without a CUDA GPU or megatron-core.

Run on the lent H200 with: pip install --no-deps megatron-core==0.16.1 &&
    python -m pytest tests/gpu/test_train_actor_gpu.py
(tests/gpu has no conftest: the CPU platform preparation lives in tests/unit and tests/e2e only.)
"""

import importlib.util
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

SHAPES = [(5, 3), (7, 4), (3, 1), (9, 5), (4, 6), (6, 2)]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from relax.platform import get_platform
    from relax.tiny_model import build_tiny_model

    platform = get_platform("cuda")
    platform.prepare_megatron()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    address = f"tcp://127.0.0.1:{port}"
    torch.distributed.init_process_group(platform.dist_backend, init_method=address, rank=0, world_size=1)
    yield str(build_tiny_model(tmp_path_factory.mktemp("qwen3"), "qwen3"))
    torch.distributed.destroy_process_group()


def _batch(vocab_size):
    from relax.train.batch import RolloutBatch

    generator = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, vocab_size - 1, (p + r,), generator=generator) for p, r in SHAPES]
    advantages = [torch.full((r,), 1.0 if i % 3 else -1.0) for i, (_, r) in enumerate(SHAPES)]
    return RolloutBatch(tokens, [r for _, r in SHAPES], advantages=advantages)


def _actor(hf_dir, bf16=False):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from relax.train.actor import ActorSettings, MegatronActor
    from relax.train.losses import LossSettings
    from relax.train.model import read_hf_config, transformer_config

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dtype = torch.bfloat16 if bf16 else torch.float32
    hf = read_hf_config(hf_dir)
    transformer = transformer_config(hf, bf16=bf16, params_dtype=dtype, perform_initialization=False)
    optimizer = OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=bf16, params_dtype=dtype)
    settings = ActorSettings(loss=LossSettings(kl_coef=0.05, entropy_coef=0.01), micro_batch_size=2)
    from relax.platform import get_platform

    ddp = DistributedDataParallelConfig()
    return MegatronActor(hf_dir, transformer, optimizer, ddp, settings, platform=get_platform("cuda"))


def test_logprobs_equal_hf_on_the_gpu(hf_dir):
    import transformers

    actor = _actor(hf_dir)
    batch = _batch(actor.hf["vocab_size"])
    logprobs = actor.compute_logprobs(batch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda().eval()
    for tokens, length, actual in zip(batch.tokens, batch.response_lengths, logprobs):
        with torch.no_grad():
            hf = reference(tokens[None].cuda()).logits[0, -length - 1 : -1].float().log_softmax(-1).cpu()
        expected = hf.gather(-1, tokens[-length:, None]).squeeze(-1)
        assert (actual - expected).abs().max() <= 1e-4


def _run(hf_dir, bf16, sleep):
    actor = _actor(hf_dir, bf16)
    batch = _batch(actor.hf["vocab_size"])
    batch.old_logprobs = batch.ref_logprobs = actor.compute_logprobs(batch)
    metrics, freed = [], []
    for _ in range(3):
        metrics.append(actor.train_step(batch))
        if sleep:
            state = [t.detach().clone() for t in actor._training_state_tensors()]
            torch.cuda.synchronize()
            allocated = torch.cuda.memory_allocated()
            actor.sleep()
            freed.append(allocated - torch.cuda.memory_allocated())
            actor.wake()
            restored = list(actor._training_state_tensors())
            assert len(state) == len(restored) and all(torch.equal(a, b) for a, b in zip(state, restored))
            del state
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in actor._training_state_tensors()}
    state_bytes = sum(storage.nbytes() for storage in storages.values())
    return metrics, freed, state_bytes


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_sleep_frees_device_memory_and_wake_changes_nothing(hf_dir, bf16):
    awake, _, _ = _run(hf_dir, bf16, sleep=False)
    slept, freed, state_bytes = _run(hf_dir, bf16, sleep=True)
    assert slept == awake
    assert all(f >= state_bytes for f in freed), (freed, state_bytes)
    losses = [m["loss"] for m in awake]
    assert losses[-1] < losses[0], losses
