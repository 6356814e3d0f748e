"""The Megatron actor on a CUDA GPU (one process, world size 1): logprobs equal HF's on the device, and
sleep hands the training state's device memory back and wake restores it bit for bit, so training goes on
exactly as if the actor had never slept; fp32 and bf16 (Float16Module, fp32 main params), with and without
the distributed optimizer, through torch_memory_saver (the CUDA record's memory saver: while asleep every
tensor of the training state is paused inside its region and the saver's host backup holds its bytes) and
through host copies (ActorSettings.memory_saver=False). Skipped without a CUDA GPU or megatron-core.

Run on the lent H200 from the repository root with the wheels in .whl (megatron-core, torch_memory_saver):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site:$PWD python3 -m pytest -q -x tests/gpu/test_train_actor_gpu.py
(tests/gpu has no conftest: the CPU platform preparation lives in tests/unit and tests/e2e only.)
"""

import gc
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
    from relax.tools.tiny_model import build_tiny_model

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


@pytest.fixture(scope="module")
def wide_hf_dir(hf_dir, tmp_path_factory):
    """The tiny model widened to about 27M parameters (a training state of some 430 MB in fp32), so that the
    memory a sleep frees is measured well above what destroying the process groups frees."""
    from relax.tools.tiny_model import build_tiny_model

    directory = tmp_path_factory.mktemp("qwen3_wide")
    return str(build_tiny_model(directory, "qwen3", hidden_size=1024, intermediate_size=4096))


def _batch(vocab_size):
    from relax.train.batch import RolloutBatch

    generator = torch.Generator().manual_seed(2)
    tokens = [torch.randint(0, vocab_size - 1, (p + r,), generator=generator) for p, r in SHAPES]
    advantages = [torch.full((r,), 1.0 if i % 3 else -1.0) for i, (_, r) in enumerate(SHAPES)]
    return RolloutBatch(tokens, [r for _, r in SHAPES], advantages=advantages)


def _actor(hf_dir, bf16=False, memory_saver=True, distributed_optimizer=False):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig

    from relax.platform import get_platform
    from relax.train.actor import ActorSettings, MegatronActor
    from relax.train.losses import LossSettings
    from relax.hf_checkpoint import read_hf_checkpoint, transformer_config

    gc.collect()  # the previous test's actor, before this one's groups and memory
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    dtype = torch.bfloat16 if bf16 else torch.float32
    hf = read_hf_checkpoint(hf_dir)
    transformer = transformer_config(hf, bf16=bf16, params_dtype=dtype, perform_initialization=False)
    optimizer = OptimizerConfig(
        optimizer="adam", lr=1e-3, clip_grad=1.0, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=distributed_optimizer,
    )
    settings = ActorSettings(
        loss=LossSettings(kl_coef=0.05, entropy_coef=0.01), micro_batch_size=2, memory_saver=memory_saver
    )
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=distributed_optimizer)
    return MegatronActor(hf_dir, transformer, optimizer, ddp, settings, platform=get_platform("cuda"))


def test_logprobs_equal_hf_on_the_gpu(hf_dir):
    import transformers

    actor = _actor(hf_dir)
    batch = _batch(actor.hf_checkpoint.text_config["vocab_size"])
    logprobs = actor.compute_logprobs(batch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).cuda().eval()
    for tokens, length, actual in zip(batch.tokens, batch.response_lengths, logprobs):
        with torch.no_grad():
            hf = reference(tokens[None].cuda()).logits[0, -length - 1 : -1].float().log_softmax(-1).cpu()
        expected = hf.gather(-1, tokens[-length:, None]).squeeze(-1)
        assert (actual - expected).abs().max() <= 1e-4


def _sleep_and_wake(actor) -> dict:
    """One sleep and wake, checked: the device memory freed (the driver's free memory for the memory saver,
    which unmaps the region; torch's allocated bytes for host copies, whose freed blocks may share cached
    segments with other tensors) and the training state's bytes; while asleep, on the memory saver route,
    whether the saver's host backup of every tensor equals it; after wake, whether every tensor is
    bit-identical."""
    from relax.train.offload import SaverRegion

    state = [t.detach().clone() for t in actor._training_state_tensors()]
    state_bytes = actor.memory.nbytes
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_awake, allocated_awake = torch.cuda.mem_get_info()[0], torch.cuda.memory_allocated()
    actor.sleep()
    freed, backed_up = allocated_awake - torch.cuda.memory_allocated(), None
    if isinstance(actor.memory, SaverRegion):
        freed = torch.cuda.mem_get_info()[0] - free_awake
        saver = actor.platform.load_memory_saver()
        backups = [saver.get_cpu_backup(t) for t in actor._training_state_tensors() if t.is_cuda and t.numel()]
        expected = [t for t in state if t.is_cuda and t.numel()]
        backed_up = all(b is not None and torch.equal(b, e.cpu()) for b, e in zip(backups, expected, strict=True))
    asleep_bytes = actor.memory.nbytes
    actor.wake()
    restored = list(actor._training_state_tensors())
    identical = len(state) == len(restored) and all(torch.equal(a, b) for a, b in zip(state, restored))
    return dict(
        freed=freed, state_bytes=state_bytes, asleep_bytes=asleep_bytes, backed_up=backed_up, identical=identical
    )


def _run(hf_dir, sleep, **actor_args):
    """Three optimizer steps (asleep between them when `sleep`): each step's metrics, the sleep checks, the
    final weights and whether every step changed them."""
    from relax.train.model import unwrap

    def weights():
        return {name: p.detach().cpu() for name, p in unwrap(actor.model).named_parameters()}

    actor = _actor(hf_dir, **actor_args)
    batch = _batch(actor.hf_checkpoint.text_config["vocab_size"])
    batch.old_logprobs = batch.ref_logprobs = actor.compute_logprobs(batch)
    metrics, checks, moved = [], [], []
    for step in range(3):
        if sleep and step:
            checks.append(_sleep_and_wake(actor))
        before = weights()
        metrics.append(actor.train_step(batch))
        moved.append(any(not torch.equal(before[name], after) for name, after in weights().items()))
    return metrics, checks, weights(), moved, type(actor.memory).__name__


ROUTES = [
    dict(bf16=False),
    dict(bf16=True),
    dict(bf16=True, distributed_optimizer=True),  # the parameters live in DDP's parameter buffer
    dict(bf16=False, memory_saver=False),  # host copies (the route of platforms without a memory saver)
]


@pytest.mark.parametrize("actor_args", ROUTES, ids=["fp32", "bf16", "bf16-distopt", "fp32-host-copies"])
def test_sleep_frees_device_memory_and_wake_changes_nothing(wide_hf_dir, actor_args):
    awake, _, awake_weights, moved, _ = _run(wide_hf_dir, sleep=False, **actor_args)
    slept, checks, slept_weights, _, route = _run(wide_hf_dir, sleep=True, **actor_args)
    assert route == ("HostCopies" if actor_args.get("memory_saver") is False else "SaverRegion")
    for check in checks:
        assert check["identical"] and check["asleep_bytes"] == 0, check
        assert check["freed"] >= check["state_bytes"] > 0, check
        assert check["backed_up"] is (True if route == "SaverRegion" else None), check
    assert slept == awake
    assert all(torch.equal(slept_weights[name], awake_weights[name]) for name in awake_weights)
    # Every step trained (a loss that falls is not promised in three PPO steps at this learning rate, with
    # the KL term and clipping).
    assert all(moved), moved
