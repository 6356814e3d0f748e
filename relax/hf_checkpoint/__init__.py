"""An HF checkpoint directory as relax reads it: config.json, the language model in it, its model family, what
that fixes in Megatron, and the tensors' names and shapes. Read once, into one frozen value that the parser
(relax.args), the engines (relax.rollout), the training actor (relax.train) and the run state share:

    checkpoint = read_hf_checkpoint("/models/Qwen3-4B")   # HFCheckpointError on anything relax cannot train
    checkpoint.text_config          # the language model's config (text_config of a vision-language checkpoint)
    checkpoint.family               # its model_type, a key of architecture.FAMILIES
    checkpoint.transformer_fields   # TransformerConfig fields config.json fixes (architecture.py)
    checkpoint.model_fields         # GPTModel-level settings config.json fixes, by Megatron flag names
    checkpoint.tensor_shapes        # name -> shape from the safetensors headers, fused experts per expert
    checkpoint.architecture         # model_type and both field sets: what a saved actor checkpoint must match
    transformer_config(checkpoint, base)  # the megatron-core TransformerConfig of the model (imports megatron)

Where the language model sits and which tensors stay frozen: layout.py. Tensor data: TensorReader.
"""

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from relax.hf_checkpoint.architecture import FAMILIES, model_fields, transformer_fields
from relax.hf_checkpoint.layout import (
    ExpertView,
    checkpoint_name,
    describe_frozen,
    is_frozen,
    language_model,
    per_expert_views,
    trained_names,
)

__all__ = [
    "HFCheckpoint",
    "HFCheckpointError",
    "TensorReader",
    "describe_frozen",
    "hf_checkpoint_of",
    "is_frozen",
    "read_hf_checkpoint",
    "trained_names",
    "transformer_config",
]


class HFCheckpointError(ValueError):
    """An HF checkpoint directory relax cannot read or train; the message names the directory or file."""


@dataclass(frozen=True)
class TensorEntry:
    """Where a tensor relax reads lives: its safetensors file, and for a per-expert tensor the fused tensor
    that holds it (layout.per_expert_views)."""

    file: Path
    shape: tuple[int, ...]
    expert_view: ExpertView | None = None


@dataclass(frozen=True)
class HFCheckpoint:
    directory: Path
    config: dict = field(repr=False)  # config.json as written
    text_config: dict = field(repr=False)  # the language model's, as a text-only config.json would hold it
    vision_language: bool  # tensors under model.language_model.* (layout.py)
    family: str  # the language model's model_type
    transformer_fields: dict = field(repr=False)
    model_fields: dict = field(repr=False)

    def checkpoint_name(self, text_name: str) -> str:
        """The checkpoint's name of a tensor the family names `text_name`."""
        return checkpoint_name(text_name, self.vision_language)

    @cached_property
    def tensors(self) -> dict[str, TensorEntry]:
        """Every tensor as relax reads it (fused experts per expert), from the safetensors headers only."""
        from safetensors import safe_open

        files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise HFCheckpointError(
                f"no *.safetensors files in {self.directory}: pass a local HF model directory with its weights"
            )
        entries = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    shape = tuple(handle.get_slice(name).get_shape())
                    views = per_expert_views(name, shape)
                    entries.update({n: TensorEntry(file, v.shape, v) for n, v in views.items()})
                    if not views:
                        entries[name] = TensorEntry(file, shape)
        return entries

    @property
    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: entry.shape for name, entry in self.tensors.items()}

    @property
    def architecture(self) -> dict:
        """What the actor's model depends on: the model_type and every field config.json fixes in Megatron. Two
        checkpoints with equal architectures hold tensors of the same names and shapes."""
        return {"model_type": self.config.get("model_type"), **self.model_fields, **self.transformer_fields}


def read_hf_checkpoint(directory: str | Path) -> HFCheckpoint:
    """The checkpoint in `directory` (its config.json; tensor headers when first asked for)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise HFCheckpointError(f"{path} does not exist: pass an HF model directory (config.json + *.safetensors)")
    try:
        config = json.loads(path.read_text())
    except OSError as exc:
        raise HFCheckpointError(f"{path} cannot be read ({exc.strerror})") from None
    except ValueError as exc:  # not JSON, or not UTF-8 text
        raise HFCheckpointError(f"{path} is not valid JSON ({exc}): pass an HF model directory") from None
    if not isinstance(config, dict):
        raise HFCheckpointError(
            f"{path} holds a JSON {type(config).__name__}, not an object: pass an HF model directory"
        )
    return hf_checkpoint_of(config, Path(directory))


def hf_checkpoint_of(config: dict, directory: Path) -> HFCheckpoint:
    """The checkpoint that `config` (a config.json's contents) describes, its tensors in `directory`."""
    path = directory / "config.json"
    try:
        text_config, vision_language = language_model(config)
    except ValueError as exc:
        raise HFCheckpointError(f"{path}: {exc}") from None
    family = text_config.get("model_type")
    if family not in FAMILIES:
        raise HFCheckpointError(
            f"{path}: model_type {family!r} (architectures {config.get('architectures')}) is not supported by "
            f"relax's Megatron actor; supported model types: {sorted(FAMILIES)}"
        )
    try:
        fields = transformer_fields(text_config), model_fields(text_config)
    except KeyError as exc:
        raise HFCheckpointError(
            f"{path}: relax cannot build this {family} model: its family mapping reads {exc}, which config.json "
            "lacks (is it the config.json of these weights?)"
        ) from None
    except ValueError as exc:
        raise HFCheckpointError(f"{path}: relax cannot build this {family} model: {exc}") from None
    return HFCheckpoint(directory, config, text_config, vision_language, family, *fields)


def transformer_config(checkpoint: HFCheckpoint, base=None, **overrides):
    """A megatron-core TransformerConfig for an HF checkpoint, as the training actor builds it and the parser
    (relax.args.megatron.family_transformer_config) checks it.

    The architecture (layers, heads, norms, MoE, ...) comes from config.json (checkpoint.transformer_fields);
    everything else (parallel sizes, dtype, recompute, ...) from `base` (a TransformerConfig, e.g. from
    relax.args) and then `overrides`.

    Built through megatron's TransformerConfig, not dataclasses.replace: MindSpeed (NPU) turns each config into an
    instance of a generated subclass whose extra fields are not constructor arguments
    (core/megatron_basic/arguments_basic.py), and replace() would construct that subclass without them.
    """
    from megatron.core.transformer import TransformerConfig

    given = {}
    if base is not None:
        given = {f.name: getattr(base, f.name) for f in dataclasses.fields(TransformerConfig) if f.init}
    return megatron_config(TransformerConfig, **{**given, **checkpoint.transformer_fields, **overrides})


def megatron_config(config_class, **fields):
    """config_class(**fields) (one of megatron-core's config dataclasses); a TransformerConfig also for Gated DeltaNet
    layers under context parallelism: megatron-core 0.16.1 asserts context_parallel_size == 1 with them because its
    own GatedDeltaNet forward passes no state between CP ranks; relax's does (relax.train.model.gdn_spec), so the
    config is built at 1 and then given the size (no other check of TransformerConfig's reads it for these models)."""
    context_parallel = fields.get("context_parallel_size") or 1
    if context_parallel == 1 or fields.get("experimental_attention_variant") != "gated_delta_net":
        return config_class(**fields)
    config = config_class(**{**fields, "context_parallel_size": 1})
    config.context_parallel_size = context_parallel
    return config


class TensorReader:
    """Tensor data of a checkpoint, read lazily by name (the names of HFCheckpoint.tensors)."""

    def __init__(self, checkpoint: HFCheckpoint):
        self.checkpoint = checkpoint
        self._handles = {}

    def get(self, name: str):
        """The tensor `name` (a torch.Tensor)."""
        from safetensors import safe_open

        entry = self.checkpoint.tensors[name]
        if entry.file not in self._handles:
            self._handles[entry.file] = safe_open(str(entry.file), framework="pt")
        handle, view = self._handles[entry.file], entry.expert_view
        if view is None:
            return handle.get_tensor(name)
        return handle.get_slice(view.fused_name)[view.expert : view.expert + 1][0, view.rows].contiguous()
