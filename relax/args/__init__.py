"""One parser, three namespaces: relax's own flags, SGLang's ServerArgs, Megatron's config dataclasses.

config = parse_train_args(argv)   # exits 2 with a message on bad input, like argparse
config.run, config.rollout, config.algorithm, config.evaluation, config.actor, config.outputs
                                  # relax's typed, frozen settings (relax.args.settings): what a run reads
config.flags                      # argparse.Namespace of relax's flags (resolved defaults filled in): what the
                                  # settings were built from, what the checks and --dry-run read
config.sglang                     # sglang.srt.server_args.ServerArgs
config.megatron                   # MegatronConfig: TransformerConfig, OptimizerConfig, DDP config, ...
config.megatron.values            # MegatronValues: the same as plain data, what training workers receive
print(format_config(config))      # what --dry-run prints
"""

import argparse
import dataclasses
from pathlib import Path

import msgspec

from relax.args.checks import check_config
from relax.args.megatron import (
    MegatronConfig,
    MegatronValues,
    add_megatron_args,
    build_megatron_config,
    family_transformer_config,
    given_values,
    resolve_architecture,
)
from relax.args.relax_flags import (
    DEVICE_CHOICES,
    OVERLONG_PENALTY_FACTOR_DEFAULT,
    TIS_CLIP_DEFAULTS,
    SLIME_SPELLINGS,
    add_relax_args,
)
from relax.args.settings import (
    AlgorithmSettings,
    EvalSettings,
    OutputSettings,
    RolloutSettings,
    RunSettings,
    actor_settings,
    algorithm_settings,
    context_length,
    eval_settings,
    output_settings,
    rollout_requests_per_engine,
    rollout_settings,
    run_settings,
)
from relax.args.sglang import (
    add_sglang_args,
    build_server_args,
    expand_sglang_config,
    prepare_import,
    redirects,
    server_args_fields,
)
from relax.args.strict import StrictArgumentParser
from relax.args.unsupported import REFUSED_VALUES, SLIME_FLAGS
from relax.hf_checkpoint import HFCheckpointError, read_hf_checkpoint
from relax.platform import platform_facts, resolve_platform_name
from relax.rollout.engine_fields import rollout_decode_graph_fields, server_defaults
from relax.rollout.rollout import DEFAULT_MAX_CHUNKS
from relax.train.algorithms import ALGORITHMS
from relax.train.losses import DUAL_CLIP, K3_CLAMP
from relax.train.settings import ActorSettings

__all__ = [
    "TrainConfig",
    "RunSettings",
    "RolloutSettings",
    "AlgorithmSettings",
    "EvalSettings",
    "ActorSettings",
    "OutputSettings",
    "MegatronConfig",
    "MegatronValues",
    "build_parser",
    "parse_train_args",
    "format_config",
]

_NAMESPACED = ("sglang_", "megatron_")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    flags: argparse.Namespace  # relax's parsed flags, defaults filled in: what the settings below are built from
    run: RunSettings
    rollout: RolloutSettings
    algorithm: AlgorithmSettings
    evaluation: EvalSettings
    actor: ActorSettings
    outputs: OutputSettings
    sglang: object  # sglang.srt.server_args.ServerArgs
    megatron: MegatronConfig


def build_parser() -> StrictArgumentParser:
    """The `relax train` parser (this imports SGLang, after preparing this machine's platform for it)."""
    prepare_import("auto")
    return _parser()


def _parser() -> StrictArgumentParser:
    parser = StrictArgumentParser(
        prog="relax train",
        description="Colocated RL post-training. relax's flags, then SGLang's (--sglang-*), then Megatron's. "
        "A relax flag's second spelling is slime's name for the same setting (give one of the two).",
        redirects={**redirects(), **SLIME_FLAGS},
        aliases=SLIME_SPELLINGS,
        refused_values={entry.setting: entry.message() for entry in REFUSED_VALUES},
    )
    add_relax_args(parser)
    add_sglang_args(parser)
    add_megatron_args(parser)
    return parser


def parse_train_args(argv: list[str]) -> TrainConfig:
    argv = list(argv)
    # The device decides how SGLang must be prepared before its flags can be imported: read it first.
    device_only = argparse.ArgumentParser(prog="relax train", add_help=False, allow_abbrev=False)
    device_only.add_argument("--device", choices=DEVICE_CHOICES, default="auto")
    # An explicit name is taken as given (a GPU run script can be dry-run on a CPU machine); only auto
    # looks at the machine. The record's facts are readable without the device.
    try:
        platform = platform_facts(resolve_platform_name(device_only.parse_known_args(argv)[0].device))
    except ValueError as exc:  # RELAX_DEVICE names no platform
        device_only.error(str(exc))
    prepare_import(platform.name)

    parser = _parser()
    argv = expand_sglang_config(argv, parser.error)
    namespace = parser.parse_args(argv)
    relax = argparse.Namespace(**{k: v for k, v in vars(namespace).items() if not k.startswith(_NAMESPACED)})
    relax.device = platform.name
    if relax.gdn_training_kernel == "auto":
        relax.gdn_training_kernel = platform.gdn_training_kernel
    _fill_relax_defaults(relax)

    checkpoint = relax.hf_checkpoint
    unreadable = checkpoint_problem(checkpoint)
    # A dry run may check a preset whose model is not there yet (its size given by flags, or refused below naming
    # the path); a path that is there must be an HF model directory.
    if unreadable and not (relax.dry_run and not Path(checkpoint).exists()):
        parser.error(unreadable)
    try:
        hf = read_hf_checkpoint(checkpoint) if checkpoint is not None and not unreadable else None
    except HFCheckpointError as exc:
        parser.error(f"--hf-checkpoint: {exc}")
    given = given_values(namespace)
    values = resolve_architecture(given, hf, parser.error, absent_checkpoint=unreadable)
    if relax.use_rollout_routing_replay:  # the actor's routers take the engine's choices (relax.train.routing_replay)
        values["moe_enable_routing_replay"] = True
    megatron = build_megatron_config(MegatronValues(values, relax.num_steps), parser.error)
    if hf is not None:  # what the actor trains: the family of config.json fixes the architecture fields
        megatron.transformer = family_transformer_config(megatron.transformer, given, hf, parser.error)
    sglang = build_server_args(
        namespace,
        argv,
        managed=dict(
            model_path=checkpoint,
            tp_size=relax.rollout_num_devices_per_engine,
            device=platform.name,
            enable_memory_saver=relax.colocate and platform.has_memory_saver,
            enable_return_routed_experts=relax.use_rollout_routing_replay,
            enable_priority_scheduling=relax.partial_rollout,
        ),
        defaults=server_defaults(platform, engine_logs=relax.engine_logs),
    )
    # Decode graphs up to the most requests an engine runs at once in the rollout (the rule and why:
    # relax.rollout.engine_fields.rollout_decode_graph_fields); the user's own sizes win.
    graphs = rollout_decode_graph_fields(server_args_fields(sglang), rollout_requests_per_engine(relax))
    sglang = msgspec.structs.replace(sglang, **graphs)
    problems = check_config(relax, megatron, sglang, platform)
    if problems:
        parser.error("\n".join(problems))
    try:
        rollout = rollout_settings(relax, context_length(hf, sglang.context_length))
        return TrainConfig(
            flags=relax,
            run=run_settings(relax),
            rollout=rollout,
            algorithm=algorithm_settings(relax),
            evaluation=eval_settings(relax, rollout.sampling),
            actor=actor_settings(relax, megatron.scheduler),
            outputs=output_settings(relax),
            sglang=sglang,
            megatron=megatron,
        )
    except ValueError as exc:  # a setting's own check (SamplingConfig, LossSettings, ...)
        parser.error(f"relax's settings reject these flags: {exc}")


def checkpoint_problem(checkpoint: str | None) -> str | None:
    """Why --hf-checkpoint names no directory with a config.json, naming the path; None when it does (or is not
    given)."""
    if checkpoint is None:
        return None
    path = Path(checkpoint)
    if not path.exists():
        return f"--hf-checkpoint {checkpoint} does not exist"
    if not path.is_dir():
        return f"--hf-checkpoint {checkpoint} is not a directory (expected an HF model directory)"
    if not (path / "config.json").is_file():
        return f"--hf-checkpoint {checkpoint}: no config.json there (expected an HF model directory)"
    return None


def _fill_relax_defaults(relax: argparse.Namespace) -> None:
    """Defaults that are other flags' values."""
    if relax.global_batch_size is None:
        relax.global_batch_size = relax.rollout_batch_size * relax.n_samples_per_prompt
    algorithm = ALGORITHMS[relax.advantage_estimator]
    clip_low, clip_high = algorithm.clip_range
    if relax.eps_clip_high is None:  # (a given --eps-clip is the upper side too)
        relax.eps_clip_high = clip_high if relax.eps_clip is None else relax.eps_clip
    if relax.eps_clip is None:
        relax.eps_clip = clip_low
    if relax.loss_aggregation is None:
        relax.loss_aggregation = algorithm.aggregation.replace("_", "-")
    if relax.eps_clip_c is None and algorithm.dual_clip:  # (likewise below: left unset where giving it is refused)
        relax.eps_clip_c = DUAL_CLIP
    if relax.use_kl_loss and relax.kl_loss_type is None:
        relax.kl_loss_type = "k3"
    if relax.use_kl_loss and relax.kl_loss_type == "k3" and relax.k3_clamp is None:
        relax.k3_clamp = K3_CLAMP
    if relax.overlong_buffer_len and relax.overlong_penalty_factor is None:
        relax.overlong_penalty_factor = OVERLONG_PENALTY_FACTOR_DEFAULT
    if relax.use_tis:  # (likewise)
        for name, default in TIS_CLIP_DEFAULTS.items():
            if getattr(relax, name) is None:
                setattr(relax, name, default)
    if relax.eval_prompt_data:  # (likewise) the eval samples as the rollout does unless told otherwise
        for name, default in (
            ("eval_n_samples_per_prompt", 1),
            ("eval_temperature", relax.rollout_temperature),
            ("eval_top_p", relax.rollout_top_p),
            ("eval_max_response_len", relax.rollout_max_response_len),
        ):
            if getattr(relax, name) is None:
                setattr(relax, name, default)
    if not (relax.load_rollout_data or relax.eval_only):  # (likewise: where no rollout is generated, giving one of
        # these is refused)
        if relax.over_sampling_batch_size is None:
            relax.over_sampling_batch_size = relax.rollout_batch_size
        if relax.rollout_max_prompts is None:
            relax.rollout_max_prompts = DEFAULT_MAX_CHUNKS * relax.over_sampling_batch_size


def format_config(config: TrainConfig) -> str:
    """The resolved configuration, one `name = value` line per field; `*` marks a value that is not the default."""
    parser = _parser()  # SGLang is imported already: parsing made this config
    relax_dests = [a.dest for a in parser._actions if a.dest in vars(config.flags)]  # in --help's order
    sections = [("relax", [(k, getattr(config.flags, k), parser.get_default(k)) for k in relax_dests])]
    # what the run reads, built from the above
    for name in ("run", "rollout", "algorithm", "evaluation", "actor", "outputs"):
        settings = getattr(config, name)
        rows = [(f.name, getattr(settings, f.name), getattr(settings, f.name)) for f in dataclasses.fields(settings)]
        sections.append((f"settings.{name} ({_class_path(settings)})", rows))  # (no defaults of their own: no *)
    sections.append((f"sglang ({_class_path(config.sglang)})", _struct_rows(config.sglang)))
    m = config.megatron
    for name in ("transformer", "optimizer", "ddp"):
        obj = getattr(m, name)
        sections.append((f"megatron.{name} ({_class_path(obj)})", _dataclass_rows(obj)))
    for name, title in (("model", "GPTModel settings"), ("scheduler", "LR schedule")):
        rows = [(k, v, parser.get_default(f"megatron_{k}")) for k, v in vars(getattr(m, name)).items()]
        sections.append((f"megatron.{name} ({title})", rows))
    lines = []
    for title, rows in sections:
        lines.append(f"== {title} ==")
        lines += [f"{'*' if _differs(value, default) else ' '} {name} = {value!r}" for name, value, default in rows]
    return "\n".join(lines)


def _class_path(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _differs(value, default) -> bool:
    try:
        return bool(value != default)
    except Exception:  # values whose == is not a bool (arrays): say they differ
        return True


def _struct_rows(record) -> list:
    rows = []
    for f in msgspec.structs.fields(type(record)):
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        else:
            default = f.default_factory() if f.default_factory is not msgspec.NODEFAULT else None
        rows.append((f.name, getattr(record, f.name), default))
    return rows


def _dataclass_rows(obj) -> list:
    rows = []
    for f in dataclasses.fields(obj):
        default = (
            f.default
            if f.default is not dataclasses.MISSING
            else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        )
        rows.append((f.name, getattr(obj, f.name), default))
    return rows
