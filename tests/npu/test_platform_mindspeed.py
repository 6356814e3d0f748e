"""relax's NPU Megatron preparation (relax.platform.npu.prepare_mindspeed) and config building under the MindSpeed
contract double (tests/npu/mindspeed_double: what MindSpeed at the pin does to megatron-core), in a subprocess on the
CPU (tests/npu/cpu_mindspeed.py). tests/e2e/test_npu_startup.py runs the whole start-up of the NPU preset so."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from relax.tools.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]


def _run_under_the_double(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "npu"), str(ROOT)])}
    env.pop("RELAX_MINDSPEED_CHECKOUT", None)
    prologue = "from cpu_mindspeed import use_mindspeed_on_cpu\nuse_mindspeed_on_cpu()\n"
    return subprocess.run(
        [sys.executable, "-c", prologue + textwrap.dedent(script)], capture_output=True, text=True, timeout=300,
        env=env,
    )


def test_fused_rope_switch_builds_the_megatron_config():
    """MindSpeed's fused-RoPE check reads position_embedding_type from every new TransformerConfig, a field neither
    megatron-core nor MindSpeed defines: relax's repatch gives it."""
    result = _run_under_the_double(
        """
        from relax.args.megatron import MegatronValues
        from relax.platform import get_platform

        get_platform("cpu").prepare_megatron({"use_fused_rotary_pos_emb": True})
        values = MegatronValues({"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}, num_steps=1)
        transformer = values.build().transformer
        assert transformer.use_fused_rotary_pos_emb and transformer.position_embedding_type == "rope"
        print("ok", type(transformer).__mro__[1].__module__)
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["ok", "megatron.core.transformer.transformer_config"]


def test_family_config_is_built_from_a_mindspeed_config(tmp_path):
    """MindSpeed's configs are instances of a generated subclass whose extra fields are not constructor arguments:
    the family config keeps the base's settings and MindSpeed's fields, on the actor's side
    (relax.hf_checkpoint.transformer_config) and on the driver's (relax.args.megatron.family_transformer_config),
    context parallelism of Gated DeltaNet layers included (built at CP = 1, then sized: relax.hf_checkpoint)."""
    model = build_tiny_model(tmp_path / "model", "qwen3_5")
    result = _run_under_the_double(
        f"""
        import dataclasses

        from relax.args.megatron import MegatronValues, family_transformer_config
        from relax.hf_checkpoint import read_hf_checkpoint, transformer_config
        from relax.platform import get_platform

        get_platform("cpu").prepare_megatron({{}})
        base = MegatronValues(
            {{"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "recompute_granularity": "full",
             "recompute_method": "uniform", "recompute_num_layers": 1, "context_parallel_size": 2}},
            num_steps=1,
        ).build().transformer
        checkpoint = read_hf_checkpoint({str(model)!r})
        family = transformer_config(checkpoint, base)
        assert family.recompute_granularity == "full" and family.experimental_attention_variant == "gated_delta_net"
        assert family.moe_zero_memory == "disable" and family.position_embedding_type == "rope"
        assert family.context_parallel_size == 2

        def refuse(message):
            raise SystemExit(message)

        driver_family = family_transformer_config(base, {{}}, checkpoint, refuse)
        # Field by field: each construction under MindSpeed may make its own generated class, so == would differ.
        assert {{f.name: getattr(driver_family, f.name) for f in dataclasses.fields(family)}} == {{
            f.name: getattr(family, f.name) for f in dataclasses.fields(family)
        }}
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ok"
