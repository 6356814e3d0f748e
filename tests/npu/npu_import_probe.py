"""Import SGLang's Ascend start-up path on a CPU and report what registered; run in a fresh interpreter.

    python tests/npu/npu_import_probe.py API_JSON [--registry]

API_JSON holds {"modules": {...}} as tests/npu/data/sgl_kernel_npu_api.json does. tests/npu/stand_ins must be on
PYTHONPATH (its torch_npu stand-in, made to report one available NPU). The sgl_kernel_npu stand-in is built from
API_JSON.
Everything else is the installed SGLang, imported for real. Prints one JSON object: is_npu, per module below either
"ok" or its import error, and with --registry whether SGLang's model registry (which imports every model module and
drops those that fail) holds each Qwen3.5 architecture.
"""

import importlib
import importlib.util
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kernel_stand_in  # noqa: E402  (tests/npu, beside this file)

# The Ascend image installs torchvision 0.25.0 beside torch 2.10.0; PyPI's torchvision does not import beside
# the CPU torch here, so relax's CPU placeholder stands in (SGLang's engine import reaches it, no Ascend path
# calls it). Loaded alone: its directory also holds relax's CPU sgl_kernel stand-in, which the NPU image lacks.
TORCHVISION_PLACEHOLDER = HERE.parents[1] / "relax" / "platform" / "cpu_stand_ins" / "torchvision" / "__init__.py"

ARCHITECTURES = ["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration"]
MODULES = [
    "sglang.srt.models.qwen3_5",
    "sglang.srt.hardware_backend.npu.attention.ascend_backend",
    "sglang.srt.hardware_backend.npu.attention.ascend_gdn_backend",
    "sglang.srt.hardware_backend.npu.attention.ascend_hybrid_linear_attn_backend",
]


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(exc), exc)).strip()


def _load_torchvision_placeholder() -> None:
    spec = importlib.util.spec_from_file_location("torchvision", TORCHVISION_PLACEHOLDER, submodule_search_locations=[])
    module = importlib.util.module_from_spec(spec)
    sys.modules["torchvision"] = module
    spec.loader.exec_module(module)


def main() -> int:
    _load_torchvision_placeholder()
    kernel_stand_in.install(json.loads(Path(sys.argv[1]).read_text())["modules"])
    import torch_npu  # the stand-in; real torch imports torch_npu through its backend entry point

    torch_npu.stand_in_one_npu()  # the NPU host SGLang's is_npu() looks for
    from sglang.srt.utils import is_npu

    report = {"is_npu": is_npu(), "modules": {}}
    for module in MODULES:
        try:
            importlib.import_module(module)
            report["modules"][module] = "ok"
        except Exception as exc:  # the report names it; the test decides
            report["modules"][module] = _error(exc)
    if "--registry" in sys.argv[2:]:
        from sglang.srt.models.registry import ModelRegistry

        supported = set(ModelRegistry.get_supported_archs())
        report["architectures"] = {arch: arch in supported for arch in ARCHITECTURES}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
