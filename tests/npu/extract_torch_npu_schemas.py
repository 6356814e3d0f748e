"""Regenerate tests/npu/torch_npu_schemas.json from a torch-npu wheel: the operator schemas of the torch_npu ops relax
calls (or switches on through MindSpeed), as the wheel declares them, each checked by torch's own schema parser.

    pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
        torch-npu==$(python relax/pins.py torch-npu) -d /tmp/torch-npu
    python tests/npu/extract_torch_npu_schemas.py /tmp/torch-npu/torch_npu-*.whl

torch_npu exposes every op of its `torch.ops.npu` namespace as `torch_npu.<name>` (torch_npu/__init__.py and
torch_npu/utils/custom_ops.py), so a call `torch_npu.npu_x(...)` binds against these schemas, all overloads of the name.
"""

import json
import re
import sys
import zipfile
from pathlib import Path

import torch
import yaml

SCHEMA_YAML = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
VERSION_FILE = "torch_npu/version.py"
OUTPUT = Path(__file__).with_name("torch_npu_schemas.json")

# The ops relax needs, each with who calls it.
OPS = {
    "npu_fusion_attention": "relax/platform/attention.py (packed causal attention, TND layout)",
    "npu_fusion_attention_grad": "MindSpeed's ring attention under context parallelism (relax/platform/attention.py "
    "mindspeed_ring): mindspeed/core/context_parallel/ring_context_parallel/ring_context_parallel.py",
    "npu_grouped_matmul": "relax/platform/grouped_linear.py (MoE experts: forward and both gradients)",
    "npu_swiglu": "MindSpeed --use-fused-swiglu: mindspeed/core/fusions/fused_bias_swiglu.py",
    "npu_rms_norm": "MindSpeed --use-fused-rmsnorm: mindspeed/core/fusions/fused_rms_norm.py",
}


def schemas_in(yaml_text: str) -> dict:
    """Every `func:` schema string of the yaml, by op name (overloads together), across all its sections."""
    found = {}
    for section in yaml.safe_load(yaml_text).values():
        for entry in section if isinstance(section, list) else []:
            func = entry.get("func") if isinstance(entry, dict) else None
            if func:
                name = func.split("(", 1)[0].split(".", 1)[0]
                found.setdefault(name, [])
                if func not in found[name]:
                    found[name].append(func)
    return found


def extract(wheel: Path) -> dict:
    with zipfile.ZipFile(wheel) as archive:
        found = schemas_in(archive.read(SCHEMA_YAML).decode())
        version_source = archive.read(VERSION_FILE).decode()
    version = re.search(r"^__version__ = '([^']+)'", version_source, re.M).group(1)
    git_version = re.search(r"^git_version = '([^']+)'", version_source, re.M).group(1)
    ops = {}
    for name, used_by in OPS.items():
        if name not in found:
            raise SystemExit(f"{wheel.name}: {SCHEMA_YAML} declares no {name}")
        for schema in found[name]:
            torch._C.parse_schema(schema)  # refuses anything torch could not bind a call against
        ops[name] = {"used_by": used_by, "schemas": found[name]}
    return {"wheel": wheel.name, "version": version, "git_version": git_version, "yaml": SCHEMA_YAML, "ops": ops}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    OUTPUT.write_text(json.dumps(extract(Path(sys.argv[1])), indent=1) + "\n")
    print(f"wrote {OUTPUT}")
