"""The double's `mindspeed.megatron_adaptor`: what importing the real one does to megatron-core, and `repatch`.

Upstream (mindspeed/megatron_adaptor.py at the pin): the module imports torch_npu.contrib.transfer_to_npu, then its
body calls patch_features(), which parses MindSpeed's arguments from sys.argv (args_utils.py get_mindspeed_args:
parse_known_args, unknown `--flag value` pairs kept as arguments too) and applies every feature's patches;
repatch(args) removes the patches, sets each item of `args` on the full arguments (args_utils.py get_full_args:
megatron.training's arguments when that package is initialised, else MindSpeed's own) and applies them again."""

import dataclasses
import functools
import inspect
import sys

import torch_npu.contrib.transfer_to_npu  # noqa: F401  (megatron_adaptor.py imports it before anything else)

from mindspeed.features import FEATURES, argument_parser

_arguments = None  # MindSpeed's arguments (args_utils.py _MINDSPEED_ARGS), parsed once
_originals = {}  # (class, attribute) -> the megatron-core function a patch replaced (patch_utils.py Patch)


def _parse_arguments():
    """args_utils.py get_mindspeed_args / parser_unknown_args: known flags parsed, unknown flags kept."""
    parsed, unknown = argument_parser().parse_known_args(sys.argv[1:])
    key = None
    for item in unknown:
        if item.startswith("--"):
            name, _, value = item[2:].partition("=")
            key = name.replace("-", "_")
            setattr(parsed, key, value if value else True)
        elif key is not None:
            setattr(parsed, key, item)
    return parsed


def _with_mindspeed_fields(init):
    """core/megatron_basic/arguments_basic.py transformer_config_init_wrapper: MindSpeed's arguments, updated with
    the constructor's keyword arguments, split by the config class's signature (the wrapper keeps the constructor's,
    functools.wraps). Those it lacks become fields of a subclass made for this instance with
    dataclasses.make_dataclass (init=False, no default), set on the instance; the others are passed to the
    constructor (so a MindSpeed argument named like a config field sets it)."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        given = {**vars(_arguments), **kwargs}
        accepted = inspect.signature(type(self)).parameters
        extra = {name: value for name, value in given.items() if name not in accepted and not hasattr(self, name)}
        self.__class__ = dataclasses.make_dataclass(
            type(self).__name__,
            [(name, type(value), dataclasses.field(init=False)) for name, value in extra.items()],
            bases=(type(self),),
        )
        for name, value in extra.items():
            setattr(self, name, value)
        init(self, *args, **{name: value for name, value in given.items() if name in accepted})

    return __init__


def _validated_by_features(post_init):
    """arguments_basic.py transformer_config_post_init_wrapper: megatron-core's own __post_init__, then every
    feature's checks on the config (features_manager/features_manager.py validate_features_args: all features,
    applied or not)."""

    @functools.wraps(post_init)
    def __post_init__(self):
        post_init(self)
        for feature in FEATURES:
            feature.check(self)

    return __post_init__


def _apply_patches() -> None:
    """features_manager/megatron_basic/megatron_basic.py (level 0, every run) patches TransformerConfig's __init__
    and __post_init__; patch_utils.py imports the target module to patch it."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    for feature in FEATURES:
        if feature.applies(_arguments):
            feature.patches(_arguments)
    for attribute, wrap in (("__init__", _with_mindspeed_fields), ("__post_init__", _validated_by_features)):
        _originals[TransformerConfig, attribute] = getattr(TransformerConfig, attribute)
        setattr(TransformerConfig, attribute, wrap(getattr(TransformerConfig, attribute)))


def _remove_patches() -> None:
    """patch_utils.py MindSpeedPatchesManager.remove_patches: the originals back."""
    for (owner, attribute), original in _originals.items():
        setattr(owner, attribute, original)
    _originals.clear()


def repatch(args) -> None:
    """megatron_adaptor.py repatch: remove the patches, copy `args` (a dict) onto the arguments, patch again."""
    _remove_patches()
    for name, value in args.items():
        setattr(_arguments, name, value)
    _apply_patches()


def patch_features() -> None:
    """megatron_adaptor.py patch_features, run by the module body once."""
    global _arguments
    if _arguments is not None:
        return
    _arguments = _parse_arguments()
    _apply_patches()


patch_features()
