"""The Qwen3.5-9B NPU preset's start-up, executed on the CPU under MindSpeed: the preset's arguments (its flags from
scripts/run-qwen35-9B-8xnpu-colocate.sh, a tiny Qwen3.5 model in place of the 9B one, two devices) go through
`relax train --dry-run`, then through Ray as a run takes them: training-rank actors prepare Megatron with the NPU
platform's MindSpeed preparation (tests/npu/cpu_mindspeed.py: torch_npu, MindSpeed's adaptor, repatch with the preset's
switches) and build the MegatronValues, the family config and the model; one training step runs on gloo.

MindSpeed is the contract double in tests/npu/mindspeed_double, or the real package with RELAX_MINDSPEED_CHECKOUT set
to a checkout of the pinned commit (docs/npu.md). Nothing here runs on an NPU or computes with an Ascend kernel."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray

from relax.args import parse_train_args
from relax.platform import get_platform
from relax.ray.local_cluster import LocalCluster
from relax.ray.placement import create_node_placement, create_training_actors
from relax.rollout.data import Prompt
from relax.rollout.groups import Sample
from relax.rollout.synthetic import write_task
from relax.run.loop import train
from relax.tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
NPU_TESTS = ROOT / "tests" / "npu"
PRESET = ROOT / "scripts" / "run-qwen35-9B-8xnpu-colocate.sh"
# What the CPU run changes in the preset's flags: two devices instead of eight (TP 2 instead of 4, one engine of 2),
# one prompt per rollout (one optimizer step of its 8 samples).
ON_TWO_DEVICES = {"--num-devices-per-node": "2", "--tensor-model-parallel-size": "2", "--rollout-batch-size": "1"}
# The GDN layers compute with relax's reference kernel: the double has no kernels, and the real MindSpeed's are
# triton-ascend kernels, whose CPU fallback (ops/triton/utils.py custom_device_ctx) calls torch.cpu.device, which
# torch 2.13 lacks.
CPU_KERNELS = ["--gdn-training-kernel", "reference"]

sys.path.insert(0, str(NPU_TESTS))
from cpu_mindspeed import CHECKOUT_ENV, MindSpeedOnCpuTrainWorker, mindspeed_in_use  # noqa: E402


def _printed_args(command: list[str], env: dict) -> list[str]:
    """The arguments a script passes to `relax train`: RELAX_PYTHON is a program that prints them."""
    printer = Path(env["EXP_DIR"]) / "print-args"
    printer.write_text("#!/bin/sh\nshift 3\nprintf '%s\\0' \"$@\"\n")  # drops `-m relax.cli train`
    printer.chmod(0o755)
    output = subprocess.run(command, env={**env, "RELAX_PYTHON": str(printer)}, capture_output=True, text=True,
                            check=True, cwd=ROOT).stdout
    return output.split("\0")[:-1]


def preset_args_with_tiny_model(exp_dir: Path) -> list[str]:
    """The 9B preset's `relax train` arguments without its model's architecture flags (scripts/models/qwen3.5-9B.sh,
    which describe the 9B model) for a tiny Qwen3.5 model and prompts under exp_dir, on two devices, with responses
    that fit the tiny model's context."""
    model = build_tiny_model(exp_dir / "model", "qwen3_5")
    prompts = write_task("copy_digit", 8, exp_dir / "prompts.jsonl")
    env = {**os.environ, "EXP_DIR": str(exp_dir), "MODEL_DIR": str(model), "DATA_DIR": str(exp_dir)}
    env.pop("RELAX_DEVICE", None)
    args = _printed_args(["bash", str(PRESET)], env)
    print_model_args = (
        'source scripts/models/qwen3.5-9B.sh && exec "$RELAX_PYTHON" -m relax.cli train "${MODEL_ARGS[@]}"'
    )
    architecture = _printed_args(["bash", "-c", print_model_args], env)
    assert args[: len(architecture)] == architecture, "the preset no longer starts with its model's flags"
    args = args[len(architecture):]
    args[args.index("--prompt-data") + 1] = str(prompts)
    for flag, value in ON_TWO_DEVICES.items():
        args[args.index(flag) + 1] = value
    args[args.index("--rollout-max-response-len") + 1] = "64"  # the preset's 8192 is past the tiny model's context
    return [*args, *CPU_KERNELS]


@pytest.fixture(scope="module")
def preset(tmp_path_factory):
    """The preset's arguments for the tiny model, and their `relax train --dry-run`, started here so that it runs
    while the cluster starts (the test reads its result)."""
    args = preset_args_with_tiny_model(tmp_path_factory.mktemp("npu_preset"))
    dry_run = subprocess.Popen([sys.executable, "-m", "relax.cli", "train", *args, "--dry-run"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    yield args, dry_run
    if dry_run.poll() is None:  # the test stopped before reading it
        dry_run.kill()
        dry_run.communicate()


@pytest.fixture(scope="module")
def cluster():
    """A one-node Ray cluster whose workers can import tests/npu (the platform and the double)."""
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(NPU_TESTS), str(ROOT), saved]))
    local = LocalCluster()
    try:
        local.start_head(num_cpus=4)
        ray.init(address=local.address)
        yield local
    finally:
        ray.shutdown()
        local.stop()
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved


def one_group(vocab_size: int, size: int) -> list[Sample]:
    prompt = Prompt(row=1, token_ids=[5, 6, 7, 8], text="")
    responses = [[(9 + 7 * i + j) % vocab_size for j in range(3 + i % 4)] for i in range(size)]
    return [Sample(prompt, tokens, [-1.0] * len(tokens), "length", reward=float(i % 2))
            for i, tokens in enumerate(responses)]


def test_the_npu_preset_starts_and_trains_a_step_under_mindspeed(preset, cluster):
    args, dry_run = preset
    stdout, stderr = dry_run.communicate(timeout=300)
    assert dry_run.returncode == 0, stdout[-2000:] + stderr[-3000:]

    config = parse_train_args(args)
    settings = config.run
    assert settings.device == "npu" and settings.megatron_features == {"use_fused_rotary_pos_emb": True}
    platform = get_platform("cpu")  # the ranks' MindSpeedOnCpu: the CPU platform with the NPU's MindSpeed path
    placement = create_node_placement(platform, settings.num_nodes, settings.num_devices_per_node)
    trainers = None
    try:
        trainers = create_training_actors(
            MindSpeedOnCpuTrainWorker, placement,
            env={CHECKOUT_ENV: os.environ[CHECKOUT_ENV]} if CHECKOUT_ENV in os.environ else None,
            args=(settings.hf_checkpoint, config.megatron.values, config.actor, platform.name,
                  settings.update_weight_buffer_size, settings.megatron_features),
        )
        ranks = ray.get(trainers.call("data_parallel_rank"))
        samples = one_group(config.megatron.model.vocab_size, config.algorithm.global_batch_size)
        metrics = train(trainers, ranks, samples, config.algorithm, settings.train_timeout)
    finally:
        if trainers is not None:
            trainers.kill()
        placement.remove()
    assert metrics["train/update_successful"] == 1.0, (mindspeed_in_use(), metrics)
    assert math.isfinite(metrics["train/grad_norm"]) and metrics["train/grad_norm"] > 0, (mindspeed_in_use(), metrics)
