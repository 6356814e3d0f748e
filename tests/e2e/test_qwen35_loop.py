"""The tiny colocated run on a hybrid Gated DeltaNet model: scripts/run-tiny-cpu.sh --tiny-model qwen3_5 for a few
steps through the real stack (local Ray, SGLang engine actor serving the GDN layers with relax's torch operators,
Megatron actor on megatron-core's GatedDeltaNet), run once for the module's two tests.

Every weight push is checked by the engine itself (relax.rollout.engine refuses unknown names, wrong shapes and
a push that misses any checkpoint tensor), so a run that completes pushed every Qwen3.5 tensor under its HF name
(in_proj_qkv/z/b/a, conv1d, A_log, dt_bias, the gated norm, gated full attention) after every step. The reward
is not asserted: it needs dozens of steps to rise (docs/benchmarks.md, "Tiny Qwen3.5 colocated run on CPU").

The run also shows that MindSpeed patches Megatron before megatron's first import in every training rank. On an
NPU, where the Qwen3.5 presets run, relax.platform.npu imports MindSpeed's adaptor (which patches megatron-core at
import) when a training rank prepares Megatron, and refuses if megatron was imported first: anything a rank
receives or imports before its platform.prepare_megatron() must not import megatron (Ray unpickles an actor's
arguments before its __init__ runs). No NPU runs here, so every process of the run starts with a sitecustomize
that makes the CPU platform's Megatron preparation import a test double for mindspeed.megatron_adaptor first, as
the NPU's does. The double records each import and fails, like the NPU platform, when megatron is already imported.
"""

import json
import os
import textwrap

import pytest

from processes import describe, leftover_processes, run_marker
from tiny_runs import PERF_KEYS, ROOT, run_tiny_job, step_records

NUM_STEPS = 3
LOG_ENV = "STAND_IN_MINDSPEED_LOG"

# The test double for MindSpeed's adaptor module.
STAND_IN_ADAPTOR = f"""
import json, os, sys

imported_first = sorted(name for name in sys.modules if name.split(".")[0] == "megatron")
with open(os.environ["{LOG_ENV}"], "a") as log:
    log.write(json.dumps({{"pid": os.getpid(), "megatron_imported_first": imported_first[:5]}}) + "\\n")
if imported_first:
    raise RuntimeError(f"megatron was imported before MindSpeed patched it: {{imported_first[:5]}}")
"""

# Runs at the start of every Python process of the run (it inherits PYTHONPATH): the CPU platform's Megatron
# preparation (relax.platform.cpu_megatron.prepare_megatron) imports the stand-in adaptor before its own work.
SITECUSTOMIZE = """
from relax.platform.post_import import PostImportHook


def _adaptor_first(module):
    prepare = module.prepare_megatron

    def prepare_megatron():
        import mindspeed.megatron_adaptor  # noqa: F401

        prepare()

    module.prepare_megatron = prepare_megatron


PostImportHook(lambda name: name == "relax.platform.cpu_megatron", _adaptor_first).install()
"""


@pytest.fixture(scope="module")
def qwen35_run(tmp_path_factory):
    """The run's directory, its metrics records, the stand-in adaptor's import records and its processes left
    behind (described; empty when none)."""
    exp_dir = tmp_path_factory.mktemp("qwen35_run")
    stand_ins = exp_dir / "stand_ins"
    (stand_ins / "mindspeed").mkdir(parents=True)
    (stand_ins / "mindspeed" / "__init__.py").write_text("")
    (stand_ins / "mindspeed" / "megatron_adaptor.py").write_text(textwrap.dedent(STAND_IN_ADAPTOR))
    (stand_ins / "sitecustomize.py").write_text(SITECUSTOMIZE)
    imports_log = exp_dir / "mindspeed_imports.jsonl"
    marker = run_marker()
    env = {
        **marker,
        "PYTHONPATH": os.pathsep.join([str(stand_ins), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        LOG_ENV: str(imports_log),
    }
    records = run_tiny_job(exp_dir, "--tiny-model", "qwen3_5", "--num-steps", str(NUM_STEPS), env=env)
    leftover = leftover_processes(marker)
    imports = [json.loads(line) for line in imports_log.read_text().splitlines()] if imports_log.exists() else []
    return {"exp_dir": exp_dir, "records": records, "imports": imports,
            "leftover": describe(leftover) if leftover else ""}


def test_tiny_qwen35_colocated_run_logs_every_phase_and_every_push_is_accepted(qwen35_run):
    config = json.loads((qwen35_run["exp_dir"] / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_text" and "linear_attention" in config["layer_types"]

    records = step_records(qwen35_run["records"])
    assert [r["step"] for r in records] == list(range(NUM_STEPS))
    for record in records:
        for key in (*PERF_KEYS, "rollout/reward_mean", "rollout/response_length_mean", "train/loss", "train/grad_norm"):
            assert key in record, f"step {record['step']} lacks {key}"
        assert record["perf/weight_sync_time"] > 0.0
        assert 0.0 <= record["rollout/reward_mean"] <= 1.0
        assert record["train/update_successful"] == 1.0
        assert record["train/grad_norm"] > 0.0  # gradients reached the policy (GDN layers included)
    assert not qwen35_run["leftover"], f"processes left behind by the run: {qwen35_run['leftover']}"


def test_the_training_rank_prepares_megatron_before_any_megatron_import(qwen35_run):
    imports = qwen35_run["imports"]
    early = [record for record in imports if record["megatron_imported_first"]]
    assert not early, f"megatron was imported before the stand-in MindSpeed patched it: {early}"
    # The run's one training rank prepared Megatron once, with the stand-in first; no other process did.
    assert len(imports) == 1, imports
