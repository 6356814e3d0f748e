"""relax serves every sgl_kernel CPU op SGLang 0.5.23's GDN models (Qwen3.5, Qwen3-Next) read, read from the
installed SGLang source, so an upgrade that needs a new op fails here rather than inside a spawned engine; and the
non-AMX shared-expert gate does what SGLang's Triton kernel does."""

import importlib.util
import re
from pathlib import Path

import torch

from relax.platform.cpu_sglang import shared_expert_gate_sigmoid_mul_add
from relax.platform.cpu_sgl_kernel_registry import CPU_OPS

SGLANG = Path(importlib.util.find_spec("sglang").origin).parent
GDN_SOURCES = [
    "srt/models/qwen3_5.py",
    "srt/models/qwen3_next.py",
    "srt/layers/attention/linear/gdn_backend.py",
    "srt/layers/attention/linear/kernels/gdn_triton.py",
    "kernels/ops/attention/fla/layernorm_gated.py",
    "kernels/ops/attention/fla/fused_norm_gate.py",
]
# Called only where weights were AMX-packed (use_intel_amx_backend), which relax's CPU platform never does.
AMX_ONLY = {"fused_input_proj_cpu"}


def _read(relative: str) -> str:
    return (SGLANG / relative).read_text()


def test_every_torch_op_the_gdn_models_read_is_registered_with_a_schema():
    import sgl_kernel  # noqa: F401  (relax's stand-in, first on the path on the CPU platform: defines the ops)

    names = {name for source in GDN_SOURCES for name in re.findall(r"torch\.ops\.sgl_kernel\.(\w+)", _read(source))}
    assert names - AMX_ONLY, "found no sgl_kernel ops: did SGLang's sources move?"
    for name in sorted(names - AMX_ONLY):
        assert name in CPU_OPS and CPU_OPS[name].schema is not None, name
        assert hasattr(torch.ops.sgl_kernel, name), name


def test_every_mamba_function_the_gdn_backend_imports_is_registered():
    imports = re.findall(r"from sgl_kernel\.mamba import ([\w, ]+)", "".join(_read(s) for s in GDN_SOURCES))
    names = {name.strip() for line in imports for name in line.split(",")}
    assert names == {"causal_conv1d_fn_cpu", "causal_conv1d_update_cpu", "chunk_gated_delta_rule_cpu"}
    for name in names:
        assert CPU_OPS[name].submodule == "mamba", name


def test_shared_expert_gate_adds_the_sigmoid_gated_shared_output_in_place():
    generator = torch.Generator().manual_seed(0)
    hidden, gate_weight, shared, routed = (torch.randn(*shape, generator=generator)
                                           for shape in ((5, 8), (8,), (5, 8), (5, 8)))
    expected = routed + torch.sigmoid(hidden @ gate_weight)[:, None] * shared
    shared_expert_gate_sigmoid_mul_add(hidden, gate_weight, shared, routed)
    torch.testing.assert_close(routed, expected)
