"""Megatron flags, generated from megatron-core's config dataclasses, and the config objects they build.

Rule: every field of TransformerConfig (with its ModelParallelConfig base), OptimizerConfig and
DistributedDataParallelConfig becomes `--field-name` (dest `megatron_<field>`), as Megatron-LM spells it,
typed from the annotation:
  int / float / str                    -> that type
  Optional[X]                          -> X (not given: the dataclass default)
  Literal[...] / an Enum               -> choices
  list[X]                              -> nargs="+"
  X | list[X]                          -> nargs="+", one value gives X (Megatron-LM's --moe-aux-loss-coeff)
  tuple[X, ...]                        -> that many values
  a union that admits str              -> one string (the dataclass parses it)
  bool                                 -> --field-name / --no-field-name
Fields that cannot be written on a command line are not flags: callables (init methods, hooks, timers),
torch dtypes (params_dtype and pipeline_dtype follow --bf16 / --fp16; the others keep their defaults),
objects (quant recipes, context managers) and private fields. A field present in several dataclasses
(--use-distributed-optimizer, --bf16, --overlap-param-gather, ...) is one flag that sets it in each.
A flag not given leaves the dataclass default. Megatron-LM spellings that differ from the field names
(--norm-epsilon, --num-experts, --disable-bias-linear, ...) are added, and the GPTModel-level and
LR-schedule settings that live in no core dataclass get flags of their own (MODEL_FLAGS, SCHEDULER_FLAGS).
Megatron-LM flags relax does not carry out (relax.args.unsupported.REFUSED_FLAGS) are errors that say why.
With an HF checkpoint the architecture comes from its config.json as relax.hf_checkpoint maps it (the one
mapping the training actor builds its model with too): resolve_architecture merges it with the flags, and
family_transformer_config applies it to the TransformerConfig as the actor does, so that --dry-run prints what
will be trained.

The resolved values (flags merged with config.json) stay plain Python data (MegatronValues: an Enum flag
holds its member's name until the config objects are built). They, not the config objects, travel to the
training workers, which build their own objects after their platform prepared Megatron: unpickling a
megatron-core object imports megatron, and on an NPU MindSpeed must patch megatron before its first import.
"""

import argparse
import dataclasses
import enum
import functools
import types
import typing
import warnings

from relax.args.strict import RefusedFlag
from relax.args.unsupported import REFUSED_FLAGS
from relax.hf_checkpoint import HFCheckpoint, megatron_config, transformer_config

PREFIX = "megatron"


@functools.cache
def config_classes() -> dict:
    """The megatron-core dataclasses that become flags, in the order that decides a shared field's type."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": true, and not news here
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.transformer.transformer_config import TransformerConfig
    return {"transformer": TransformerConfig, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}


PLAIN_TYPES = (type(None), bool, int, float, str)


def _is_plain(value) -> bool:
    if isinstance(value, (list, tuple)):
        return all(_is_plain(item) for item in value)
    return type(value) in PLAIN_TYPES


@dataclasses.dataclass(frozen=True)
class MegatronValues:
    """The resolved Megatron settings as plain Python data: what MegatronConfig's objects are built from.

    Sent to the training workers in place of the objects (see the module docstring); building there gives the
    objects the driver checked and printed, less the model family's mapping, which the actor applies itself."""

    resolved: dict  # unprefixed flag name -> value: given flags and the checkpoint's architecture
    num_steps: int  # --num-steps, the default LR decay length

    def __post_init__(self):
        for name, value in self.resolved.items():
            if not _is_plain(value):
                raise TypeError(
                    f"Megatron setting {name}={value!r} is a {type(value).__module__}.{type(value).__qualname__}: "
                    "MegatronValues holds only plain Python values (None, bool, int, float, str, lists and tuples "
                    "of them), which a training worker can receive before it prepares Megatron"
                )

    def build(self) -> "MegatronConfig":
        """The config objects, in a process that has prepared Megatron (platform.prepare_megatron()).
        The values were checked where they were parsed: a rejection here is a bug, raised as ValueError."""

        def error(message: str):
            raise ValueError(message)

        return build_megatron_config(self, error)


@dataclasses.dataclass
class MegatronConfig:
    values: MegatronValues  # what the objects below are built from; what training workers receive
    transformer: typing.Any  # megatron.core.transformer.TransformerConfig
    optimizer: typing.Any  # megatron.core.optimizer.OptimizerConfig
    ddp: typing.Any  # megatron.core.distributed.DistributedDataParallelConfig
    model: argparse.Namespace  # GPTModel-level settings (vocab, positions, embeddings tying)
    scheduler: argparse.Namespace  # LR schedule (OptimizerParamScheduler's arguments)


# Model-level settings in no core dataclass, with Megatron-LM's spellings. Defaults of None are filled
# from the HF checkpoint's config.json, else as the help says.
MODEL_FLAGS = {
    "vocab_size": dict(type=int, help="Vocabulary size (default: the HF config's vocab_size)."),
    "max_position_embeddings": dict(type=int, help="Maximum positions (default: the HF config's)."),
    "position_embedding_type": dict(
        choices=["learned_absolute", "rope", "mrope", "none"], default="rope", help="(default: %(default)s)"
    ),
    "rotary_base": dict(type=float, help="RoPE base (default: the HF config's rope_theta, else 10000)."),
    "rotary_percent": dict(
        type=float,
        help="Fraction of each head's dims that are rotated "
        "(default: the HF config's partial_rotary_factor, else 1.0).",
    ),
    "untie_embeddings_and_output_weights": dict(
        action="store_const",
        const=True,
        help="Separate input embedding and output layer (default: the HF config's tie_word_embeddings).",
    ),
    "swiglu": dict(
        action="store_const",
        const=True,
        help="Gated linear unit with SiLU (sets gated_linear_unit and activation_func).",
    ),
    "group_query_attention": dict(
        action="store_const", const=True, help="Use --num-query-groups (Megatron-LM ignores it otherwise)."
    ),
}
SCHEDULER_FLAGS = {
    "lr_decay_style": dict(
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        default="constant",
        help="(default: %(default)s)",
    ),
    "lr_decay_iters": dict(type=int, help="Steps over which the LR decays (default: --num-steps)."),
    "lr_warmup_iters": dict(type=int, default=0, help="Linear warmup steps (default: %(default)s)."),
    "lr_warmup_fraction": dict(
        type=float, help="Warmup as a fraction of --lr-decay-iters (instead of --lr-warmup-iters)."
    ),
    "lr_warmup_init": dict(type=float, default=0.0, help="LR at the start of warmup (default: %(default)s)."),
}
# Megatron-LM spellings of dataclass fields that differ from the field name: (flag, field, const).
# const None: another name for the field's own flag (takes the same value); otherwise the flag stores const.
MEGATRON_LM_SPELLINGS = [
    ("--norm-epsilon", "layernorm_epsilon", None),
    ("--num-experts", "num_moe_experts", None),
    ("--disable-bias-linear", "add_bias_linear", False),
    ("--accumulate-allreduce-grads-in-fp32", "grad_reduce_in_fp32", True),
    ("--recompute-activations", "recompute_granularity", "selective"),
    ("--no-rope-fusion", "apply_rope_fusion", False),
    ("--no-bias-swiglu-fusion", "bias_activation_fusion", False),
    ("--no-bias-gelu-fusion", "bias_activation_fusion", False),
]

REQUIRED_MODEL_FIELDS = ("num_layers", "hidden_size", "num_attention_heads")


class CliForm(typing.NamedTuple):
    kwargs: dict  # for add_argument
    convert: typing.Callable | None = None  # applied to the parsed value, giving the plain resolved value
    to_field: typing.Callable | None = None  # turns the resolved value into the dataclass's (an Enum member)


def _cli_form(annotation) -> CliForm | None:
    """How a field's annotation is written on the command line, or None when it cannot be."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        if len(members) == 1:
            return _cli_form(members[0])
        scalars = [m for m in members if m in (int, float, str)]
        lists = [m for m in members if typing.get_origin(m) in (list, typing.List)]
        if (
            len(scalars) == 1
            and len(lists) == len(members) - 1
            and all(typing.get_args(m) == (scalars[0],) for m in lists)
        ):
            return CliForm({"nargs": "+", "type": scalars[0]}, _scalar_if_one)
        return CliForm({"type": str}) if str in members else None
    if annotation is bool:
        return CliForm({"action": argparse.BooleanOptionalAction})
    if annotation in (int, float, str):
        return CliForm({"type": annotation})
    if origin is typing.Literal:
        return CliForm({"type": type(args[0]), "choices": list(args)})
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return CliForm({"type": str, "choices": list(annotation.__members__)}, to_field=annotation.__getitem__)
    if origin in (list, typing.List) and len(args) == 1 and args[0] in (int, float, str):
        return CliForm({"nargs": "+", "type": args[0]})
    if origin in (tuple, typing.Tuple) and args and all(a in (int, float, str) for a in args) and len(set(args)) == 1:
        return CliForm({"nargs": len(args), "type": args[0]}, tuple)
    return None


def _scalar_if_one(values: list):
    return values[0] if len(values) == 1 else values


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@functools.cache
def field_flags() -> tuple[dict, dict, list]:
    """(field -> CliForm, field -> the classes that have it, [fields that are not flags])."""
    forms, owners, skipped = {}, {}, []
    for cls in config_classes().values():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            owners.setdefault(f.name, []).append(cls)
            if f.name in forms or f.name in skipped:
                continue
            form = None if f.name.startswith("_") else _cli_form(hints[f.name])
            if form is None:
                skipped.append(f.name)
            else:
                forms[f.name] = form
    return forms, owners, skipped


def _default_text(field: str, owners: list) -> str:
    parts = []
    for cls in owners:
        f = next(f for f in dataclasses.fields(cls) if f.name == field)
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        parts.append(f"{cls.__name__}.{field}, default {default!r}")
    return "; ".join(parts).replace("%", "%%")  # argparse %-formats help


def add_megatron_args(parser: argparse.ArgumentParser) -> None:
    forms, owners, skipped = field_flags()
    aliases = {field: flag for flag, field, const in MEGATRON_LM_SPELLINGS if const is None}
    group = parser.add_argument_group(
        "Megatron (megatron-core TransformerConfig, OptimizerConfig, DistributedDataParallelConfig)",
        "Generated from the dataclass fields. Not flags (no command-line form): " + ", ".join(skipped) + ".",
    )
    for field, form in forms.items():
        kwargs = dict(form.kwargs)
        options = [_flag(field)] + ([aliases[field]] if field in aliases else [])
        if "choices" not in kwargs and "action" not in kwargs:
            kwargs.setdefault("metavar", field.upper())
        group.add_argument(
            *options, dest=f"{PREFIX}_{field}", default=None, help=_default_text(field, owners[field]), **kwargs
        )
    for flag, field, const in MEGATRON_LM_SPELLINGS:
        if const is not None:
            help = f"Megatron-LM's spelling of {_flag(field)} {const}."
            group.add_argument(flag, dest=f"{PREFIX}_{field}", action="store_const", const=const, help=help)
    group = parser.add_argument_group("Megatron model (GPTModel) and LR schedule")
    for name, kwargs in {**MODEL_FLAGS, **SCHEDULER_FLAGS}.items():
        metavar = {} if "choices" in kwargs or "action" in kwargs else {"metavar": name.upper()}
        group.add_argument(_flag(name), dest=f"{PREFIX}_{name}", **metavar, **kwargs)
    for entry in REFUSED_FLAGS:
        dest = f"{PREFIX}_{entry.setting[2:].replace('-', '_')}"  # never set: giving the flag is an error
        group.add_argument(
            entry.setting,
            dest=dest,
            default=argparse.SUPPRESS,
            action=RefusedFlag,
            reason=f"is not supported: {entry.reason}; {entry.instead}",
            help=f"Refused: {entry.reason}; {entry.instead}.",
        )


def given_values(namespace: argparse.Namespace) -> dict:
    """The Megatron flags' values by unprefixed name; dataclass fields that were not given are left out."""
    forms, _, _ = field_flags()
    values = {}
    for dest, value in vars(namespace).items():
        if not dest.startswith(PREFIX + "_"):
            continue
        name = dest[len(PREFIX) + 1 :]
        if name in forms:
            if value is None:
                continue
            if forms[name].convert is not None:
                value = forms[name].convert(value)
        values[name] = value
    return values


def checkpoint_architecture(checkpoint: HFCheckpoint) -> dict:
    """What the checkpoint's config.json fixes, by Megatron flag name: every field of the model family's mapping
    that is a flag (the activation function follows --swiglu / --gated-linear-unit)."""
    forms, _, _ = field_flags()
    fields = {**checkpoint.model_fields, **checkpoint.transformer_fields}
    found = {
        name: value for name, value in fields.items() if (name in forms or name in MODEL_FLAGS) and _is_plain(value)
    }
    if "num_query_groups" in found:
        found["group_query_attention"] = True
    return found


def resolve_architecture(given: dict, checkpoint: HFCheckpoint | None, error, absent_checkpoint: str | None) -> dict:
    """Flags merged with the checkpoint's architecture; every architecture flag must agree with it.
    `absent_checkpoint`: why --hf-checkpoint was not read (a dry run's path not there yet), or None.

    The training actor (relax.train.model) builds the model from config.json alone, so a flag that says
    otherwise (even a setting such as --norm-epsilon or --rotary-base) would be silently ignored there:
    it is an error instead. A per-layer list (--linear-attention-freq) is compared as the model reads it, by
    family_transformer_config."""
    from_hf = checkpoint_architecture(checkpoint) if checkpoint else {}
    merged = dict(given)
    for name, value in from_hf.items():
        if given.get(name) is None:
            merged[name] = value
        elif given[name] != value and not isinstance(value, list):
            error(
                f"{_flag(name)} {given[name]} disagrees with {checkpoint.directory}/config.json ({value}); relax "
                "builds the model from the checkpoint's config: drop the flag, or edit config.json"
            )
    missing = [_flag(name) for name in REQUIRED_MODEL_FIELDS if not merged.get(name)]
    if missing and absent_checkpoint:
        error(
            f"{absent_checkpoint}: relax reads the Megatron model size from its config.json; fix the path, or give "
            f"{', '.join(missing)} to dry-run without the model"
        )
    if missing:
        error(
            f"the Megatron model size is unknown: give {', '.join(missing)} "
            f"(or --hf-checkpoint DIR with a config.json, which supplies them)"
        )
    return merged


def build_megatron_config(resolved: MegatronValues, error) -> MegatronConfig:
    """Real megatron-core config objects from resolved values (flags + checkpoint architecture)."""
    import torch
    import torch.nn.functional as F

    classes = config_classes()
    forms, _, _ = field_flags()
    values = {
        name: forms[name].to_field(value) if name in forms and forms[name].to_field and value is not None else value
        for name, value in resolved.resolved.items()
    }
    if values.get("bf16") and values.get("fp16"):
        error("--bf16 and --fp16 are exclusive")
    dtype = torch.bfloat16 if values.get("bf16") else torch.float16 if values.get("fp16") else torch.float32
    if values.get("num_query_groups") is not None and not values.get("group_query_attention"):
        error("--num-query-groups needs --group-query-attention (Megatron-LM ignores it otherwise)")
    if not values.get("group_query_attention"):
        values.pop("num_query_groups", None)
    if values.get("sequence_parallel") and (values.get("tensor_model_parallel_size") or 1) == 1:
        # megatron-core's own rule (ModelParallelConfig refuses it), said with the flags and the fix
        error(
            "--sequence-parallel needs --tensor-model-parallel-size > 1: sequence parallelism splits the activations "
            "over the tensor-parallel group, and megatron-core refuses it without tensor parallelism; drop "
            "--sequence-parallel or raise --tensor-model-parallel-size"
        )
    derived = {"params_dtype": dtype, "pipeline_dtype": dtype}
    if values.get("swiglu"):
        derived.update(gated_linear_unit=True, activation_func=F.silu)
    built = {}
    for key, cls in classes.items():
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kwargs = {n: v for n, v in {**values, **derived}.items() if n in names}
        try:
            with warnings.catch_warnings():
                if "cuda_graph_scope" not in values:
                    # TransformerConfig warns about its own default ("full"), which it then replaces.
                    warnings.filterwarnings("ignore", message="full scope is deprecated")
                built[key] = megatron_config(cls, **kwargs)
        except (ValueError, AssertionError, TypeError) as exc:
            error(f"megatron-core {cls.__name__} rejects these flags: {exc}")
    model = argparse.Namespace(**{name: values.get(name) for name in MODEL_FLAGS})
    model.untie_embeddings_and_output_weights = bool(model.untie_embeddings_and_output_weights)
    model.swiglu = bool(model.swiglu)
    model.group_query_attention = bool(model.group_query_attention)
    if model.rotary_base is None:
        model.rotary_base = 10000.0
    if model.rotary_percent is None:
        model.rotary_percent = 1.0
    scheduler = argparse.Namespace(**{name: values.get(name) for name in SCHEDULER_FLAGS})
    if scheduler.lr_decay_iters is None:
        scheduler.lr_decay_iters = resolved.num_steps
    return MegatronConfig(values=resolved, model=model, scheduler=scheduler, **built)


def family_transformer_config(transformer, given: dict, checkpoint: HFCheckpoint, error):
    """The TransformerConfig the training actor builds: `transformer` with the architecture fields the model
    family of config.json fixes, built by the actor's own function (relax.hf_checkpoint.transformer_config, which
    says why it constructs a TransformerConfig instead of using dataclasses.replace).

    A flag given on the command line that the family overrides with another value would be silently
    ignored by the actor: it is an error naming the flag."""
    try:
        family = transformer_config(checkpoint, base=transformer)
    except (ValueError, AssertionError, TypeError) as exc:
        error(f"--hf-checkpoint: relax's Megatron actor cannot build this {checkpoint.family} model: {exc}")
    for name in sorted(given.keys() & {f.name for f in dataclasses.fields(transformer)}):
        yours, theirs = _meaning(name, transformer), _meaning(name, family)
        if yours != theirs:
            error(
                f"{_flag(name)} {getattr(transformer, name)} disagrees with the {checkpoint.family} model of "
                f"--hf-checkpoint ({name} = {getattr(family, name)}); relax builds that model as its family "
                "mapping says: drop the flag"
            )
    return family


def _meaning(name: str, config):
    """A field's value as the model reads it (an int --linear-attention-freq is a per-layer pattern)."""
    if name == "linear_attention_freq" and config.linear_attention_freq is not None:
        from megatron.core.models.gpt.experimental_attention_variant_module_specs import (
            get_linear_attention_pattern,
        )

        return get_linear_attention_pattern(config)
    return getattr(config, name)
