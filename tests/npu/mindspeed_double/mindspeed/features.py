"""The MindSpeed features the double models: their arguments (dest -> default, as registered with argparse) and the
fields their checks read from a TransformerConfig. Each record names the upstream file it follows.

The real package registers about 140 arguments over some 90 features (features_manager/__init__.py); every one of them
becomes an extra field of each TransformerConfig. The double registers those below, enough to reproduce the contract:
relax's switches, the arguments the checks below read, and MindSpeed's own optimisation level."""

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Feature:
    name: str  # MindSpeedFeature.feature_name: the argument whose truth turns it on (features_manager/feature.py)
    optimization_level: int  # 0: applied in every run whatever the arguments (feature.py, is_need_apply)
    arguments: dict = field(default_factory=dict)  # dest -> default
    check: Callable[[Any], None] = lambda config: None  # validate_args on a TransformerConfig
    patches: Callable[[Any], None] = lambda megatron_args: None  # register_patches, given MindSpeed's arguments

    def applies(self, args) -> bool:
        """features_manager/feature.py is_need_apply: level-0 features always; others when their argument is true
        and MindSpeed's --optimization-level admits them."""
        return self.optimization_level == 0 or (
            self.optimization_level <= args.optimization_level and bool(getattr(args, self.name, None))
        )


def _fused_rope_check(config) -> None:
    # features_manager/fusions/fused_rope.py validate_args: the switch needs position_embedding_type "rope", read as a
    # plain attribute (megatron-core's TransformerConfig has no such field; MindSpeed's arguments have none either).
    if config.use_fused_rotary_pos_emb and config.position_embedding_type != "rope":
        raise AssertionError("--use-fused-rotary-pos-emb must enable with --position-embedding-type=rope")


def _moe_zero_memory_check(config) -> None:
    # features_manager/moe/moe_zero_memory.py pre_validate_args: reads moe_zero_memory_num_layers and moe_zero_memory.
    if config.moe_zero_memory_num_layers is not None and config.moe_zero_memory == "disable":
        raise AssertionError("--moe-zero-memory-num-layers needs --moe-zero-memory")


def _fused_moe_permute_check(config) -> None:
    # features_manager/fusions/fused_moe_permute.py validate_args: reads the switch and megatron's moe_permute_fusion.
    if config.use_fused_moe_token_permute_and_unpermute and config.moe_token_dispatcher_type == "allgather":
        raise AssertionError("the fused MoE permute does not serve the allgather dispatcher")


FEATURES = (
    # features_manager/megatron_basic/requirements_basic.py: --optimization-level (default 2) and
    # --optimizer-selection (default fused_adamw).
    Feature("requirements_basic", 0, {"optimization_level": 2, "optimizer_selection": "fused_adamw"}),
    # features_manager/megatron_basic/megatron_basic.py: registers --use-fused-rmsnorm and --use-fused-swiglu and
    # patches TransformerConfig's __init__ / __post_init__ (the class swap and the checks: megatron_adaptor.py here).
    Feature("megatron_basic", 0, {"use_fused_rmsnorm": False, "use_fused_swiglu": False}),
    # features_manager/fusions/fused_bias_swiglu.py: FusedSwigluFeature ("use-swiglu", level 0) swaps megatron's
    # SwiGLU functions in every run, whatever --use-fused-swiglu says.
    Feature("use_swiglu", 0),
    Feature("use_fused_rotary_pos_emb", 0, {"use_fused_rotary_pos_emb": False}, _fused_rope_check),
    Feature(
        "use_fused_moe_token_permute_and_unpermute", 1, {"use_fused_moe_token_permute_and_unpermute": False},
        _fused_moe_permute_check,
    ),
    Feature("moe_zero_memory", 2, {"moe_zero_memory": "disable", "moe_zero_memory_num_layers": None},
            _moe_zero_memory_check),
)


def argument_parser() -> argparse.ArgumentParser:
    """MindSpeed's parser of its own arguments (args_utils.py get_mindspeed_args), with the double's features."""
    parser = argparse.ArgumentParser(description="MindSpeed Arguments (relax's contract double)", allow_abbrev=False)
    for feature in FEATURES:
        for dest, default in feature.arguments.items():
            flag = "--" + dest.replace("_", "-")
            if isinstance(default, bool):
                parser.add_argument(flag, action="store_true")
            else:
                parser.add_argument(flag, type=type(default) if default is not None else int, default=default)
    return parser
