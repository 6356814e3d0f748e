"""`relax train --dry-run` through the installed console script, run once for the module: each flag shows up in
its own namespace, and the placement names the bundles of the actor and of each engine."""

import subprocess
import sys
from pathlib import Path

import pytest

from relax.tools.tiny_model import build_tiny_model

RELAX = Path(sys.executable).parent / "relax"  # the console script of this virtualenv


def sections(output: str) -> dict[str, dict[str, str]]:
    """'== title ==' headers followed by '<mark> name = value' lines -> {first word of title: {name: value}}."""
    found, current = {}, None
    for line in output.splitlines():
        if line.startswith("== "):
            current = found.setdefault(line.strip("= ").split()[0], {})
        elif current is not None and " = " in line:
            name, _, value = line[2:].partition(" = ")
            current[name] = value
    return found


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The checkpoint and the finished dry run: two training ranks (TP=2) and, apart from them (--no-colocate),
    two engines of two devices each."""
    checkpoint = build_tiny_model(tmp_path_factory.mktemp("dry_run"), "qwen3")  # 56 tokens, 4 query heads / 2 KV
    argv = ["train", "--dry-run", "--device", "cpu", "--hf-checkpoint", str(checkpoint), "--lr", "2e-6"]
    argv += ["--prompt-data", "prompts.jsonl", "--reward-fn", "math", "--rollout-batch-size", "4",
             "--n-samples-per-prompt", "2"]
    argv += ["--num-devices-per-node", "2", "--tensor-model-parallel-size", "2", "--use-distributed-optimizer"]
    argv += ["--no-colocate", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2"]
    argv += ["--sglang-mem-fraction-static", "0.05", "--sglang-attention-backend", "torch_native",
             "--no-sglang-enable-tf32-matmul"]
    result = subprocess.run([str(RELAX), *argv], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return checkpoint, result.stdout


def test_dry_run_prints_flags_in_their_namespaces(dry_run):
    checkpoint, stdout = dry_run
    s = sections(stdout)
    assert set(s) == {
        "relax",
        *(f"settings.{group}" for group in ("run", "rollout", "evaluation", "algorithm", "actor", "outputs")),
        "sglang",
        "megatron.transformer",
        "megatron.optimizer",
        "megatron.ddp",
        "megatron.model",
        "megatron.scheduler",
    }
    assert s["relax"]["rollout_batch_size"] == "4" and s["relax"]["device"] == "'cpu'"
    assert s["settings.rollout"]["batch_size"] == "4" and s["settings.algorithm"]["global_batch_size"] == "8"
    assert s["sglang"]["mem_fraction_static"] == "0.05" and s["sglang"]["attention_backend"] == "'torch_native'"
    assert s["sglang"]["enable_tf32_matmul"] == "False" and s["sglang"]["model_path"] == repr(str(checkpoint))
    assert s["megatron.transformer"]["tensor_model_parallel_size"] == "2"
    assert s["megatron.transformer"]["num_query_groups"] == "2"  # from the checkpoint's config.json
    assert s["megatron.optimizer"]["lr"] == "2e-06"
    assert (
        s["megatron.optimizer"]["use_distributed_optimizer"] == "True"
        and s["megatron.ddp"]["use_distributed_optimizer"] == "True"
    )
    assert s["megatron.model"]["vocab_size"] == "56"  # the checkpoint's, unpadded (engines get HF shapes)
    # The architecture the actor builds (the qwen3 family's), not megatron-core's generic defaults.
    transformer = s["megatron.transformer"]
    assert transformer["qk_layernorm"] == "True" and transformer["add_bias_linear"] == "False"
    for name in ("mem_fraction_static", "tensor_model_parallel_size", "lr"):
        assert name not in s["relax"]  # nothing leaks into relax's own namespace
    assert "tensor_model_parallel_size" not in s["sglang"]


def test_dry_run_shows_which_bundles_the_actor_and_each_engine_take(dry_run):
    _, stdout = dry_run
    assert ("placement: 6 bundle(s) (the actor's, then the engines')\n"
            "  training ranks 0-1: bundles 0-1 (1 node(s) x 2)\n"
            "  engine 0: bundles 2-3\n"
            "  engine 1: bundles 4-5\n") in stdout
