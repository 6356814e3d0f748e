"""Every scripts/run-*.sh in dry-run mode (RELAX_DRY_RUN=1): its flags parse and pass relax's checks, so a
script with a bad flag fails CI. Also shellcheck over the scripts and the model flag files they source."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from relax.platform import platform_facts
from relax.ray.placement import engine_positions
from relax.sync.broadcast import SAME_DEVICE, SAME_NODE, plan_pushes

REPO = Path(__file__).resolve().parents[2]
RUN_SCRIPTS = sorted((REPO / "scripts").glob("run-*.sh"))
# The flag the misrouting test un-prefixes, and the preset that has it.
SGLANG_FLAG, SCRIPT_WITH_IT = "--sglang-mamba-radix-cache-strategy", "run-qwen35-9B-8xnpu-colocate.sh"


def _start_dry_run(script: Path, exp_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, RELAX_DRY_RUN="1", RELAX_PYTHON=sys.executable, EXP_DIR=str(exp_dir))
    for name in ("RELAX_DEVICE", "MODEL_DIR", "DATA_DIR", "OUTPUT_DIR", "NUM_NODES", "NUM_DEVICES_PER_NODE"):
        env.pop(name, None)
    return subprocess.Popen(
        ["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=exp_dir
    )


def _scripts_copy_with_unprefixed_flag(root: Path) -> Path:
    """A copy of scripts/ in which the preset's SGLang flag lost its --sglang- prefix."""
    shutil.copytree(REPO / "scripts", root / "scripts")
    script = root / "scripts" / SCRIPT_WITH_IT
    text = script.read_text()
    assert SGLANG_FLAG in text, f"{SCRIPT_WITH_IT} no longer has {SGLANG_FLAG}: pick another flag for this test"
    script.write_text(text.replace(SGLANG_FLAG, "--" + SGLANG_FLAG.removeprefix("--sglang-")))
    return script


@pytest.fixture(scope="module")
def dry_runs(tmp_path_factory):
    """Each script's dry run (and the misrouted copy's, key "misrouted"), started together: each costs seconds
    of imports and Megatron/SGLang config building. Values: (returncode, stdout, stderr, EXP_DIR)."""
    started = {}
    for script in RUN_SCRIPTS:
        exp_dir = tmp_path_factory.mktemp(script.stem)
        started[script.name] = (_start_dry_run(script, exp_dir), exp_dir)
    root = tmp_path_factory.mktemp("misrouted")
    started["misrouted"] = (_start_dry_run(_scripts_copy_with_unprefixed_flag(root), root), root)
    done = {}
    for name, (process, exp_dir) in started.items():
        stdout, stderr = process.communicate(timeout=600)
        done[name] = (process.returncode, stdout, stderr, exp_dir)
    return done


def _setting(stdout: str, section: str, name: str) -> str:
    """The printed value of `name` in the `== section ...` block of a dry run's output."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"== {section} "))
    for line in lines[start + 1 :]:
        if line.startswith("== "):
            break
        if line[2:].startswith(f"{name} = "):
            return line[2:].split(" = ", 1)[1]
    raise KeyError(f"{name} not in section {section}")


@pytest.mark.parametrize("name", [p.name for p in RUN_SCRIPTS])
def test_run_script_passes_relax_train_dry_run(dry_runs, name):
    returncode, stdout, stderr, exp_dir = dry_runs[name]
    assert returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert "== megatron.model" in stdout  # the resolved settings were printed
    # Every path defaults to a place under EXP_DIR: no machine-specific absolute paths.
    for setting in ("hf_checkpoint", "prompt_data", "output_dir"):
        assert _setting(stdout, "relax", setting).startswith(repr(str(exp_dir))[:-1]), setting


def test_presets_cover_the_npu_and_the_gpu(dry_runs):
    devices = {_setting(dry_runs[p.name][1], "relax", "device") for p in RUN_SCRIPTS}
    assert {"'npu'", "'cuda'"} <= devices


def test_the_moe_preset_spans_two_nodes_and_its_flags_reach_megatron_and_sglang(dry_runs):
    out = dry_runs["run-qwen35-35B-A3B-16xnpu-colocate.sh"][1]
    expected = {
        ("relax", "num_nodes"): "2",
        ("relax", "num_devices_per_node"): "16",
        ("megatron.transformer", "tensor_model_parallel_size"): "8",
        ("megatron.transformer", "pipeline_model_parallel_size"): "2",
        ("megatron.transformer", "expert_model_parallel_size"): "16",
        ("megatron.transformer", "moe_token_dispatcher_type"): "'alltoall'",
        ("megatron.transformer", "experimental_attention_variant"): "'gated_delta_net'",
        ("megatron.transformer", "num_moe_experts"): "256",
        ("megatron.ddp", "overlap_grad_reduce"): "True",
        ("megatron.ddp", "overlap_param_gather"): "True",
        ("sglang", "mem_fraction_static"): "0.85",
        ("sglang", "attention_backend"): "'ascend'",
    }
    assert {key: _setting(out, *key) for key in expected} == expected


def test_the_dense_npu_preset_sets_its_sglang_switches(dry_runs):
    out = dry_runs["run-qwen35-9B-8xnpu-colocate.sh"][1]
    assert _setting(out, "sglang", "mamba_radix_cache_strategy") == "'extra_buffer'"
    assert _setting(out, "sglang", "tokenizer_backend") == "'fastokens'"
    assert _setting(out, "megatron.transformer", "tensor_model_parallel_size") == "4"
    assert _setting(out, "relax", "use_dynamic_batch_size") == "True"


@pytest.mark.parametrize("name", ["run-qwen35-9B-8xnpu-colocate.sh", "run-qwen35-35B-A3B-16xnpu-colocate.sh"])
def test_npu_presets_correct_the_engines_sampling_with_tis(dry_runs, name):
    """As Relax's Ascend scripts do: truncated importance sampling, with relax's default cap."""
    out = dry_runs[name][1]
    assert (_setting(out, "relax", "use_tis"), _setting(out, "relax", "tis_clip")) == ("True", "2.0")


@pytest.mark.parametrize("name", [p.name for p in RUN_SCRIPTS])
def test_each_presets_engine_ranks_take_weights_from_their_own_device_or_by_broadcast(dry_runs, name):
    """The weight-push plan of the preset's layout (relax.sync.broadcast), with the stages Megatron's own rank
    generator gives the training ranks: where handles do not cross devices (NPU) every handle comes from the
    engine rank's own device, and no broadcast reaches a device of its sender."""
    from megatron.core.parallel_state import RankGenerator

    out = dry_runs[name][1]
    nodes, per_node, per_engine = (int(_setting(out, "relax", key)) for key in (
        "num_nodes", "num_devices_per_node", "rollout_num_devices_per_engine"))
    tp, pp, cp = (int(_setting(out, "megatron.transformer", f"{kind}_parallel_size")) for kind in (
        "tensor_model", "pipeline_model", "context"))
    platform = platform_facts(ast.literal_eval(_setting(out, "relax", "device")))
    world = nodes * per_node
    ranks = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    pipelines = ranks.get_ranks("pp")
    stage_of = {rank: stage for pipeline in pipelines for stage, rank in enumerate(pipeline)}
    node_of = [rank // per_node for rank in range(world)]
    pushes = plan_pushes([stage_of[rank] for rank in range(world)], node_of, per_engine, platform.handles_cross_devices)

    engines = engine_positions(world, per_engine)
    every_stage_and_engine = [(stage, engine) for stage in range(pp) for engine in range(len(engines))]
    assert sorted((push.stage, push.engine) for push in pushes) == every_stage_and_engine
    for push in pushes:
        devices = tuple(engines[push.engine])
        if push.route == SAME_DEVICE:
            assert push.ranks == devices, push  # engine rank r takes the payload of the training rank on its device
        elif push.route == SAME_NODE:
            assert platform.handles_cross_devices and node_of[push.ranks[0]] == node_of[devices[0]], push
        else:
            assert push.ranks[0] not in devices, push
    if not platform.handles_cross_devices:
        assert SAME_NODE not in {push.route for push in pushes}


def test_an_unprefixed_sglang_flag_in_a_script_fails_its_dry_run(dry_runs):
    returncode, _, stderr, _ = dry_runs["misrouted"]
    assert returncode != 0
    bare = "--" + SGLANG_FLAG.removeprefix("--sglang-")
    assert f"unknown flag {bare}: did you mean {SGLANG_FLAG}?" in stderr


def test_shellcheck_passes_on_the_scripts():
    shellcheck = Path(sys.executable).parent / "shellcheck"
    files = sorted((REPO / "scripts").glob("*.sh")) + sorted((REPO / "scripts" / "models").glob("*.sh"))
    done = subprocess.run([str(shellcheck), "-x", *map(str, files)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr
