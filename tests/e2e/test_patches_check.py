"""`relax patches check` against the pinned upstreams (downloaded once from PyPI into ~/.cache/relax),
its failure on a patch that no longer applies, and the megatron-core set doing what it says: a GPTModel
trains on the CPU with no redirection of torch.cuda once the set is applied (and cannot without it).
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from relax.ports import free_port
from relax.tools import patches

REPO = Path(__file__).resolve().parents[2]


def _relax(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "relax.cli", *args], capture_output=True, text=True, cwd=REPO, **kwargs
    )


def test_check_applies_every_pypi_backed_set_with_git_am():
    done = _relax("patches", "check")
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("sglang", "megatron-core"):
        assert re.search(rf"^{name} \S+: \d+ patch\(es\) apply with git am", done.stdout, re.M), done.stdout
    # the upstreams not on PyPI are reported as not applied here, never silently passed over
    for name in ("sgl-kernel-npu", "mindspeed"):
        assert re.search(rf"^{name}\b.*(no patches|NOT applied here)", done.stdout, re.M), done.stdout


@pytest.mark.skipif(not os.environ.get("RELAX_SGL_KERNEL_NPU_CHECKOUT"),
                    reason="opt-in: RELAX_SGL_KERNEL_NPU_CHECKOUT names a git repository of sgl-kernel-npu "
                    "holding the pinned tag (CI cannot reach GitHub)")
def test_check_applies_the_sgl_kernel_npu_set_to_a_checkout_of_the_pinned_tag():
    checkout = os.environ["RELAX_SGL_KERNEL_NPU_CHECKOUT"]
    done = _relax("patches", "check", "sgl-kernel-npu", "--checkout", f"sgl-kernel-npu={checkout}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^sgl-kernel-npu \S+: \d+ patch\(es\) apply with git am \(checkout ", done.stdout, re.M), \
        done.stdout


def test_check_fails_naming_the_patch_file_and_hunk(tmp_path):
    copy = tmp_path / "patches"
    shutil.copytree(REPO / "patches", copy)
    broken = sorted((copy / "megatron-core").glob("0002-*.patch"))[0]
    text = broken.read_text()
    # a context line of the FP32Optimizer hunk that upstream does not have
    context = "         super(FP32Optimizer, self).__init__(optimizer, config, init_state_fn)\n"
    assert text.count(context) == 1
    broken.write_text(text.replace(context, context.replace("init_state_fn", "init_state")))

    done = _relax("patches", "check", "megatron-core", "--manifest", str(copy / "manifest.toml"))
    assert done.returncode == 1
    assert f"FAILED megatron-core: {broken} does not apply to megatron-core" in done.stdout, done.stdout
    assert re.search(
        r"megatron/core/optimizer/optimizer\.py: hunk #\d+ \(@@ -\d+,\d+ \+\d+,\d+ @@\): does not apply", done.stdout
    ), done.stdout


TRAIN_ON_CPU = textwrap.dedent(
    """
    import os, sys, torch
    import megatron.core
    assert megatron.core.__file__.startswith(sys.argv[1]), megatron.core.__file__
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               hidden_dropout=0.1, attention_dropout=0.1)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=64,
                     max_sequence_length=16, position_embedding_type="rope")
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0), [model])
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, -1)
    losses = []
    for _ in range(4):
        optimizer.zero_grad()
        loss = model(tokens, positions, None, labels=tokens).mean()
        loss.backward()
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    print("LOSSES", losses)
    """
)


def test_megatron_core_set_lets_a_gpt_model_train_on_cpu_without_redirections(tmp_path):
    installed = Path(importlib.util.find_spec("megatron.core").origin).parents[1]
    upstream = patches.load_manifest()["megatron-core"]
    script = tmp_path / "train_on_cpu.py"
    script.write_text(TRAIN_ON_CPU)
    env = {k: v for k, v in os.environ.items() if k not in ("RELAX_DEVICE", "PYTHONPATH")}

    results = {}
    for label in ("unpatched", "patched"):
        root = tmp_path / label
        shutil.copytree(installed, root / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
        if label == "patched":
            patches.apply(upstream, root)
        results[label] = subprocess.run(
            [sys.executable, str(script), str(root), str(free_port())],
            capture_output=True,
            text=True,
            timeout=300,
            env=dict(env, PYTHONPATH=str(root)),
        )
    assert results["patched"].returncode == 0, results["patched"].stderr[-3000:]
    assert "LOSSES" in results["patched"].stdout
    # the reason the set exists: the same script fails on the unpatched release
    assert results["unpatched"].returncode != 0
    assert "Torch not compiled with CUDA enabled" in results["unpatched"].stderr
