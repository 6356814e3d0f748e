"""relax's megatron-core patch set changes nothing on CUDA: a GPTModel with dropout (the RNG tracker), rotary
embeddings, DDP, the distributed optimizer and gradient clipping, run through the schedule, gives bit-identical
losses and gradient norm with the set applied and without it. Skipped without a CUDA GPU or megatron-core.

Run once on the lent H200 (torch 2.11.0+cu130, Python 3.12; the two megatron trees carried in): identical
losses [6.27503, 5.41162, 4.92249, 4.50326, 4.13409] and grad norm 7.50440 for both.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from relax.ports import free_port
from relax.tools import patches

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="needs megatron-core"),
]

TRAIN = textwrap.dedent(
    """
    import os, sys, torch
    import megatron.core

    assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=4, hidden_size=256, num_attention_heads=8, hidden_dropout=0.1,
                               attention_dropout=0.1)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=512,
                     max_sequence_length=128, position_embedding_type="rope").cuda()
    model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0, use_distributed_optimizer=True), [model]
    )
    config.finalize_model_grads_func = finalize_model_grads
    tokens = torch.randint(0, 512, (4, 128), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(128).expand(4, -1).cuda()


    def step(data_iterator, model):
        out = model(tokens, positions, None, labels=tokens)
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})


    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        model.zero_grad_buffer()
        result = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[model],
                                             num_microbatches=1, seq_length=128, micro_batch_size=4, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        losses.append(result[0]["loss"].item())
    print("RESULT", losses, grad_norm)
    """
)


def test_megatron_core_set_is_bit_identical_on_cuda(tmp_path):
    installed = Path(importlib.util.find_spec("megatron.core").origin).parents[1]
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    results = {}
    for label in ("unpatched", "patched"):
        root = tmp_path / label
        shutil.copytree(installed, root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
        if label == "patched":
            patches.apply(patches.load_manifest()["megatron-core"], root)
        env = dict(os.environ, PYTHONPATH=str(root))
        done = subprocess.run(
            [sys.executable, str(script), str(root), str(free_port())],
            capture_output=True, text=True, timeout=600, env=env,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results[label] = [line for line in done.stdout.splitlines() if line.startswith("RESULT")]
    assert results["patched"] and results["patched"] == results["unpatched"]
