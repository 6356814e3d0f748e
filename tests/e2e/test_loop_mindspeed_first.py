"""MindSpeed patches Megatron before megatron's first import in every training rank, through the real loop.

On an NPU, relax.platform.npu imports MindSpeed's adaptor (which patches megatron-core at import) when a
training rank prepares Megatron, and refuses if megatron was imported first: anything a rank receives or
imports before its platform.prepare_megatron() must not import megatron (Ray unpickles an actor's arguments
before its __init__ runs). No NPU runs here, so the tiny CPU job (scripts/run-tiny-cpu.sh, two steps) runs
with a test double for MindSpeed: every process of the run starts with a sitecustomize that makes the CPU
platform's Megatron preparation import a stand-in mindspeed.megatron_adaptor first, as the NPU's does. The
stand-in records each import and fails, like the NPU platform, when megatron is already imported.
"""

import json
import os
import subprocess
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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


def test_tiny_run_prepares_megatron_before_any_megatron_import_in_its_training_rank(tmp_path):
    stand_ins = tmp_path / "stand_ins"
    (stand_ins / "mindspeed").mkdir(parents=True)
    (stand_ins / "mindspeed" / "__init__.py").write_text("")
    (stand_ins / "mindspeed" / "megatron_adaptor.py").write_text(textwrap.dedent(STAND_IN_ADAPTOR))
    (stand_ins / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "mindspeed_imports.jsonl"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(stand_ins), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        LOG_ENV: str(log),
        "EXP_DIR": str(tmp_path),
        "RELAX_PYTHON": str(ROOT / ".venv" / "bin" / "python"),
    }
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "run-tiny-cpu.sh"), "--num-steps", "2"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    imports = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    early = [record for record in imports if record["megatron_imported_first"]]
    assert not early, f"megatron was imported before the stand-in MindSpeed patched it: {early}"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    # The run's one training rank prepared Megatron once, with the stand-in first; no other process did.
    assert len(imports) == 1, imports
    steps = [json.loads(line)["step"] for line in (tmp_path / "output" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1]
