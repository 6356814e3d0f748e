"""HF <-> Megatron model families: build a megatron-core GPTModel (local layer spec, no TransformerEngine)
from an HF directory, load its safetensors into the (TP/EP/PP-sharded) model, and export the model back
under HF names with the shards gathered.

The checkpoint comes as relax.hf_checkpoint reads it (an HFCheckpoint: config.json, the language model in it, its
family, the TransformerConfig fields it fixes, the tensors' names and shapes). Each family's record
(relax.hf_checkpoint.architecture.FAMILIES) names its module here (qwen2.py, qwen3.py, qwen3_moe.py, ...), which
holds its tensor-name mapping and layer spec and nothing else (FamilyNames); the rules take the language model's
config (HFCheckpoint.text_config):
  top_level_rules(hf)               Megatron name -> Rule for embedding, final norm, output layer
  layer_rules(hf)                   the same for `decoder.layers.{i}.*` ({layer} in HF names)
  expert_rules(hf)                  the same for `mlp.experts.local_experts.{j}.*` ({expert} in HF names); with
                                    --moe-grouped-gemm the same rules map each expert's slice of the grouped
                                    `mlp.experts.linear_fc1.weight` / `linear_fc2.weight` (grouped_experts.py)
  block_spec(config, hf)            the decoder's layer specs (megatron-core's local spec, or the hybrid GDN one)
A Rule maps both ways: loading fuses its HF tensors into the Megatron one, exporting unfuses them. Its layout kinds
(how HF tensors fuse and how TP cuts them) are in layouts.py. A vision-language checkpoint's tensor names differ
from the family's (HFCheckpoint.checkpoint_name renames them).

megatron.core must be importable when these functions run: on the CPU call
`relax.platform.get_platform("cpu").prepare_megatron()` before importing megatron.
"""

import dataclasses
import importlib
import re
from collections.abc import Iterator
from typing import Protocol

import torch

from relax.hf_checkpoint import HFCheckpoint, TensorReader, describe_frozen, is_frozen
from relax.hf_checkpoint.architecture import FAMILIES
from relax.train.model.core_attention import with_core_attention
from relax.train.model.gdn_spec import with_gdn_kernel
from relax.train.model.grouped_experts import with_grouped_experts
from relax.train.model.layouts import AttentionLayout, Rule, fuse, tp_shard, tp_unshard, unfuse


class FamilyNames(Protocol):
    """What a family module defines (see the module doc); `hf` is the language model's config."""

    def top_level_rules(self, hf: dict) -> dict[str, Rule]: ...

    def layer_rules(self, hf: dict) -> dict[str, Rule]: ...

    def expert_rules(self, hf: dict) -> dict[str, Rule]: ...

    def block_spec(self, config, hf: dict): ...


def family_names(checkpoint: HFCheckpoint) -> FamilyNames:
    """The module its family record (HFCheckpoint.family, a key of FAMILIES) names."""
    return importlib.import_module(f"{__name__}.{FAMILIES[checkpoint.family].names}")


_LAYER_NAME = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT_NAME = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.+)")
_GROUPED_EXPERTS_NAME = re.compile(r"mlp\.experts\.(linear_fc[12]\.weight)")  # grouped_experts.py


def build_gpt_model(
    checkpoint: HFCheckpoint,
    config,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    attention_kernel: str = "sdpa",
    gdn_kernel: str = "reference",
    context_parallel_attention: str = "all-gather",
):
    """A GPTModel with megatron-core's local layer spec for this HF config, for this process's pipeline
    stage (first/last stage from parallel_state unless given). parallel_output=True: logits stay
    vocab-sharded across TP ranks. Softmax attention computes with relax's CoreAttention and `attention_kernel`
    (the platform's, relax.platform.attention), across CP ranks with `context_parallel_attention` (the platform's
    too); the model takes packed rows (PackedSeqParams) and no mask. GDN layers compute with the training kernel
    `gdn_kernel` (relax.kernels.gdn_training)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    hf, settings = checkpoint.text_config, checkpoint.model_fields
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    if settings["vocab_size"] % tp_size:
        raise ValueError(
            f"vocab_size {settings['vocab_size']} is not divisible by tensor-model-parallel size {tp_size}; choose a "
            "TP size that divides it (relax does not pad the vocabulary)"
        )
    if config.num_moe_experts:
        _define_te_general_gemm_without_te()
    spec = family_names(checkpoint).block_spec(config, hf)
    if FAMILIES[checkpoint.family].gated_delta_net:
        spec = with_gdn_kernel(spec, gdn_kernel)
    if config.moe_grouped_gemm:
        spec = with_grouped_experts(spec)
    spec = with_core_attention(spec, attention_kernel, context_parallel_attention)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=settings["vocab_size"],
        max_sequence_length=settings["max_position_embeddings"],
        pre_process=parallel_state.is_pipeline_first_stage() if pre_process is None else pre_process,
        post_process=parallel_state.is_pipeline_last_stage() if post_process is None else post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=not settings["untie_embeddings_and_output_weights"],
        position_embedding_type="rope",
        rotary_percent=settings["rotary_percent"],
        rotary_base=settings["rotary_base"],
    )
    _mark_tensor_parallel_parameters(model, checkpoint)
    return model


def _mark_tensor_parallel_parameters(model, checkpoint: HFCheckpoint) -> None:
    """Set megatron's TP attributes (tensor_model_parallel, partition_dim, partition_stride) from the family's
    layouts. megatron-core sets them only while it initialises weights; with perform_initialization=False
    (weights come from the checkpoint anyway) they stay unset, every TP rank but the first then counts as a
    duplicate, and the gradient norm (so clipping) leaves out their shards."""
    from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

    mapping = _Mapping(model, checkpoint)
    for name, param in mapping.model.named_parameters():
        place = mapping.place(name)
        kind = place.rule.kind
        if kind != "replicated" and not hasattr(param, "tensor_model_parallel"):  # biases always have them
            dim = (1 if kind == "row" else 0) + place.stacked  # grouped experts: the expert dimension comes first
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def _define_te_general_gemm_without_te() -> None:
    """megatron-core 0.16.1's MoE router reads moe_utils.te_general_gemm, a name that module binds only when
    TransformerEngine imports (`if te_general_gemm is not None`, moe_utils.py:1192): without TE every MoE
    forward raises NameError. Binding it to None selects the plain torch.mm path the code already has."""
    from megatron.core.transformer.moe import moe_utils

    if not moe_utils.HAVE_TE and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def unwrap(model):
    """The GPTModel inside Megatron's wrappers (DDP, Float16Module)."""
    while hasattr(model, "module"):
        model = model.module
    return model


@dataclasses.dataclass(frozen=True)
class _Placement:
    """Where a local parameter sits: its rule (HF names resolved) and its TP/EP groups."""

    rule: Rule
    tp_rank: int
    tp_size: int
    tp_group: object
    local_expert: int | None  # index among this rank's experts, for expert parameters
    stacked: bool = False  # the parameter holds all local experts along dim 0 (grouped_experts.py); rule: expert 0's


class _Mapping:
    """Resolves the local Megatron parameter names of one model (one PP stage, one TP/EP rank)."""

    def __init__(self, model, checkpoint: HFCheckpoint):
        from megatron.core import parallel_state as ps

        self.model = unwrap(model)
        self.hf = hf = checkpoint.text_config
        self.family = family_names(checkpoint)
        config = self.model.config
        self.attention = AttentionLayout(config.num_attention_heads, config.num_query_groups, config.kv_channels)
        # The family's rules with the checkpoint's tensor names.
        self.top, self.layer, self.expert = (
            {
                name: Rule(rule.kind, tuple(map(checkpoint.checkpoint_name, rule.hf_names)))
                for name, rule in rules.items()
            }
            for rules in (self.family.top_level_rules(hf), self.family.layer_rules(hf), self.family.expert_rules(hf))
        )
        self.tied = bool(hf.get("tie_word_embeddings", False))
        self.num_experts = config.num_moe_experts or 0
        self.ep_size = ps.get_expert_model_parallel_world_size() if self.num_experts else 1
        self.ep_rank = ps.get_expert_model_parallel_rank() if self.num_experts else 0
        self.ep_group = ps.get_expert_model_parallel_group() if self.num_experts else None
        self.local_experts = self.num_experts // self.ep_size
        self.dense_tp = (
            ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_tensor_model_parallel_group(),
        )
        self.expert_tp = (
            (
                ps.get_expert_tensor_parallel_rank(),
                ps.get_expert_tensor_parallel_world_size(),
                ps.get_expert_tensor_parallel_group(),
            )
            if self.num_experts
            else None
        )

    def place(self, name: str, ep_rank: int | None = None, local_expert: int = 0) -> _Placement:
        """The placement of local parameter `name`; expert HF names for EP rank `ep_rank` (default: own) and, for
        grouped experts, local expert `local_expert` among those the parameter holds."""
        layer_match = _LAYER_NAME.fullmatch(name)
        if layer_match is None:
            return self._placement(name, self.top, name, {}, self.dense_tp, None)
        local_layer, rest = layer_match.groups()
        layer = self.model.decoder.layers[int(local_layer)].layer_number - 1  # global index under PP
        expert_match = _EXPERT_NAME.fullmatch(rest)
        grouped_match = _GROUPED_EXPERTS_NAME.fullmatch(rest)
        if expert_match is not None:
            local_expert, expert_rest = int(expert_match.group(1)), expert_match.group(2)
        elif grouped_match is not None:
            expert_rest = grouped_match.group(1)
        else:
            return self._placement(name, self.layer, rest, {"layer": layer}, self.dense_tp, None)
        expert = (self.ep_rank if ep_rank is None else ep_rank) * self.local_experts + local_expert
        fields = {"layer": layer, "expert": expert}
        return self._placement(
            name, self.expert, expert_rest, fields, self.expert_tp, local_expert, stacked=grouped_match is not None
        )

    def per_expert(self, name: str, tensor: torch.Tensor, ep_rank: int | None = None):
        """(placement, tensor) for each unit of parameter `name` that HF tensors map to, `tensor` being EP rank
        `ep_rank`'s copy of it: the tensor itself, or each expert's slice of grouped experts."""
        place = self.place(name, ep_rank)
        if not place.stacked:
            return [(place, tensor)]
        return [(self.place(name, ep_rank, j), expert_tensor) for j, expert_tensor in enumerate(tensor)]

    def _placement(self, name, rules, key, fields, tp, local_expert, stacked=False) -> _Placement:
        if key not in rules:
            raise KeyError(
                f"Megatron parameter {name!r} has no HF mapping in family {self.family.__name__} "
                "(does the TransformerConfig match the HF config.json?)"
            )
        rule = rules[key]
        rule = Rule(rule.kind, tuple(n.format(**fields) for n in rule.hf_names))
        return _Placement(rule, *tp, local_expert, stacked)

    def all_hf_names(self) -> set[str]:
        """Every HF tensor name the whole model (all layers, all experts) is made of."""
        names = {n for rule in self.top.values() for n in rule.hf_names}
        for layer in range(self.hf["num_hidden_layers"]):
            names |= {n.format(layer=layer) for rule in self.layer.values() for n in rule.hf_names}
            for expert in range(self.num_experts):
                names |= {n.format(layer=layer, expert=expert) for rule in self.expert.values() for n in rule.hf_names}
        return names


def _whole_shape(kind: str, shard_shape: torch.Size, tp_size: int) -> list[int]:
    shape = list(shard_shape)
    if kind == "row":
        shape[1] *= tp_size
    elif kind != "replicated":
        shape[0] *= tp_size
    return shape


def load_hf_weights(model, checkpoint: HFCheckpoint) -> None:
    """Copy an HF checkpoint into this rank's shard of `model` (one PP stage, one TP/EP rank).

    Every tensor is read lazily, only the ones this stage needs. A tensor the model needs but the checkpoint
    lacks, a tensor of the wrong shape, or a checkpoint tensor the family does not map, is an error naming it;
    the frozen ones (relax.hf_checkpoint.layout.FROZEN_PREFIXES: vision tower, MTP head) are left alone, in one
    line.
    """
    hf_dir = checkpoint.directory
    mapping = _Mapping(model, checkpoint)
    tensors = TensorReader(checkpoint)
    shapes = checkpoint.tensor_shapes
    not_mapped = shapes.keys() - mapping.all_hf_names()
    frozen = {name for name in not_mapped if is_frozen(name)}
    unexpected = not_mapped - frozen
    if frozen and (not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0):
        print(f"relax: {hf_dir}: {describe_frozen(frozen)}", flush=True)
    if unexpected:
        raise ValueError(
            f"{hf_dir}: tensors not mapped by family {mapping.family.__name__}: {sorted(unexpected)[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''} (is config.json the one these weights belong to?)"
        )
    for name, param in mapping.model.named_parameters():
        for place, target in mapping.per_expert(name, param):
            whole_shape = _whole_shape(place.rule.kind, target.shape, place.tp_size)
            expected = unfuse(place.rule.kind, torch.empty(whole_shape, device="meta"), mapping.attention)
            for hf_name, expected_tensor in zip(place.rule.hf_names, expected):
                if hf_name not in shapes:
                    raise KeyError(f"{hf_dir}: tensor {hf_name!r} (for Megatron {name!r}) is missing")
                if list(shapes[hf_name]) != list(expected_tensor.shape):
                    raise ValueError(
                        f"{hf_dir}: tensor {hf_name!r} has shape {list(shapes[hf_name])} but Megatron {name!r} "
                        f"needs {list(expected_tensor.shape)}"
                    )
            whole = fuse(place.rule.kind, [tensors.get(n) for n in place.rule.hf_names], mapping.attention)
            with torch.no_grad():
                target.copy_(tp_shard(place.rule.kind, whole, place.tp_rank, place.tp_size))


def _all_gather(tensor: torch.Tensor, size: int, group) -> list[torch.Tensor]:
    if size == 1:
        return [tensor]
    shards = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(shards, tensor.contiguous(), group=group)
    return shards


def export_hf_weights(model, checkpoint: HFCheckpoint) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, whole tensor) for every parameter of this PP stage, TP shards (and EP experts) gathered.

    One parameter is gathered at a time, so at most one whole tensor (times the EP size for experts) exists
    beyond the model. Collective: every rank of the TP/EP groups must iterate in step. Each PP stage yields
    its own layers (with global layer indices); the stages together cover the model once. A tied lm_head
    is not yielded (it is model.embed_tokens.weight).
    """
    mapping = _Mapping(model, checkpoint)
    for name, param in mapping.model.named_parameters():
        if mapping.tied and name == "output_layer.weight":
            continue
        place = mapping.place(name)
        kind = place.rule.kind
        shards = _all_gather(param.detach(), place.tp_size, place.tp_group)
        if place.stacked:  # grouped experts: unshard expert by expert
            whole = torch.stack([tp_unshard(kind, list(expert_shards)) for expert_shards in zip(*shards)])
        else:
            whole = tp_unshard(kind, shards)
        if place.local_expert is None:
            yield from zip(place.rule.hf_names, unfuse(kind, whole, mapping.attention))
            continue
        for ep_rank, ep_whole in enumerate(_all_gather(whole, mapping.ep_size, mapping.ep_group)):
            for expert_place, expert_whole in mapping.per_expert(name, ep_whole, ep_rank):
                yield from zip(expert_place.rule.hf_names, unfuse(kind, expert_whole, mapping.attention))
