"""Actor checkpoints with megatron-core's dist_checkpointing, and their conversion to an HF directory.

A checkpoint directory holds the model and optimizer as sharded tensors (dist_checkpointing's torch_dist
format: the model loads at any TP/PP layout; the distributed optimizer's state, saved "dp_reshardable",
needs the same TP/PP layout and may change only the DP size), the LR scheduler, step and Adam step counts
as common state, each rank's RNG states, and under hf/ the non-weight files of the HF model it started
from (config.json, tokenizer, generation config) and the tensors the actor does not train (a Qwen3.5
vision-language checkpoint's vision tower and MTP head, relax/hf_checkpoint/layout.py), so that
`checkpoint_to_hf` needs nothing else and writes a whole checkpoint again.

All functions are collective over the actor's ranks.
"""

import json
import random
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from relax.hf_checkpoint import HFCheckpoint, TensorReader, is_frozen, read_hf_checkpoint, transformer_config
from relax.train.model import build_gpt_model, export_hf_weights, unwrap

HF_FILES_DIR = "hf"
FROZEN_FILE = "frozen.safetensors"  # under HF_FILES_DIR
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "dp_reshardable"}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")


def _rng_state(platform) -> dict:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "device": platform.device_module.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict, platform) -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    platform.device_module.set_rng_state(state["device"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state(actor, step: int, rng: dict | None, is_loading: bool = False) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model_state = unwrap(actor.model).sharded_state_dict()
    return {
        "model": model_state,
        # is_loading creates the optimizer state (Adam's moments) to load into, on a fresh actor. The
        # distributed optimizer's default format (fully_sharded_model_space) is deprecated and fails in
        # megatron-core 0.16.1 ("flattened_range is not supported"); fully_reshardable loads at any layout.
        "optimizer": actor.optimizer.sharded_state_dict(
            model_state, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT
        ),
        "scheduler": actor.scheduler.state_dict(),
        "step": step,
        "adam_steps": _adam_steps(actor),
        # One RNG state per rank: they differ across ranks (megatron's tracker seeds per TP/PP rank).
        "rng": ShardedObject("rng_state", rng, (world,), (rank,), replica_id=0),
    }


def save_checkpoint(actor, directory: str | Path, step: int) -> None:
    """Save the actor's model, optimizer, scheduler, step and RNG states to an empty `directory`."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if torch.distributed.get_rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if any(directory.iterdir()):
            raise FileExistsError(f"checkpoint directory {directory} is not empty; save each step to a new one")
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded_state(actor, step, _rng_state(actor.platform)), str(directory))
    if torch.distributed.get_rank() == 0:
        # After megatron's save, which warns "Overwriting old incomplete / corrupted checkpoint" into a
        # directory that is not empty.
        _copy_hf_files(actor.hf_checkpoint.directory, directory / HF_FILES_DIR)
        _save_frozen_tensors(actor.hf_checkpoint, directory / HF_FILES_DIR / FROZEN_FILE)
    torch.distributed.barrier()


def load_checkpoint(actor, directory: str | Path) -> int:
    """Load what save_checkpoint wrote into the actor (see the module doc for which layouts load; the RNG
    states need the world size they were saved with). Returns the saved step."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise FileNotFoundError(f"{directory} is not a relax/megatron distributed checkpoint")
    _create_optimizer_state(actor)
    template = _sharded_state(actor, 0, _rng_state(actor.platform), is_loading=True)
    state = dist_checkpointing.load(template, str(directory))
    unwrap(actor.model).load_state_dict(state["model"])
    with torch.no_grad():  # the distributed optimizer copies into its (leaf) main params
        actor.optimizer.load_state_dict(state["optimizer"])
    _restore_adam_steps(actor, state["adam_steps"])
    actor.scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"], actor.platform)
    return state["step"]


def _create_optimizer_state(actor) -> None:
    """Give a fresh actor's optimizer the state a checkpoint is loaded into (Adam's moments and step).

    megatron-core 0.16.1 creates the moments itself when loading (init_state_fn), but not torch Adam's
    "step"; without TransformerEngine or Apex the distributed optimizer reads "step" of every state while
    building the template (distrib_optimizer.py:642, `assert len(steps) == 1`) and fails on a fresh actor.
    The values are placeholders: the checkpoint overwrites them."""
    for optimizer in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        if getattr(optimizer, "init_state_fn", None) is None:
            continue
        optimizer.init_state_fn(optimizer.optimizer, optimizer.config)
        for state in optimizer.optimizer.state.values():
            state.setdefault("step", torch.zeros((), dtype=torch.float32))


def _adam_steps(actor) -> list[float | None]:
    """Each optimizer's Adam step count (the same for all its parameters), None before the first step."""
    steps = []
    for optimizer in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer]):
        values = {float(state["step"]) for state in optimizer.optimizer.state.values() if "step" in state}
        if len(values) > 1:
            raise RuntimeError(f"parameters of one optimizer are at different Adam steps: {sorted(values)}")
        steps.append(values.pop() if values else None)
    return steps


def _restore_adam_steps(actor, steps: list[float | None]) -> None:
    """Give every parameter's state its own "step" tensor with the saved count.

    Without TransformerEngine or Apex, megatron-core 0.16.1's DistributedOptimizer.load_state_dict gives
    all parameters one shared "step" tensor (distrib_optimizer.py:825) taken from its param groups, which
    held the fresh actor's count, not the checkpoint's; torch Adam then increments the shared tensor once
    per parameter. Both skew Adam's bias correction, so the count is saved by relax and set here."""
    optimizers = getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
    for optimizer, step in zip(optimizers, steps, strict=True):
        for param_state in optimizer.optimizer.state.values():
            if step is None:
                param_state.pop("step", None)
            else:
                param_state["step"] = torch.tensor(step, dtype=torch.float32)


def _copy_hf_files(source: Path, destination: Path) -> None:
    """The HF directory's files other than weights: config, tokenizer, generation config, templates."""
    destination.mkdir(parents=True, exist_ok=True)
    for path in Path(source).iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, destination / path.name)


def _frozen_names(checkpoint: HFCheckpoint) -> list[str]:
    """The frozen tensors among the checkpoint's safetensors (headers only; none without safetensors)."""
    if not any(checkpoint.directory.glob("*.safetensors")):
        return []
    return sorted(name for name in checkpoint.tensors if is_frozen(name))


def _save_frozen_tensors(checkpoint: HFCheckpoint, out_file: Path) -> dict[str, int]:
    """Copy the frozen tensors among the checkpoint's safetensors (if any) to `out_file`; their sizes in bytes."""
    names = _frozen_names(checkpoint)
    if not names:
        return {}
    tensors = TensorReader(checkpoint)
    frozen = {name: tensors.get(name) for name in names}
    save_file(frozen, str(out_file), metadata={"format": "pt"})
    return {name: t.numel() * t.element_size() for name, t in frozen.items()}


def save_hf(model, hf_files: HFCheckpoint, out_dir: str | Path) -> None:
    """Write `model` (this rank's shard of a Megatron GPTModel of `hf_files`) as an HF directory: safetensors
    (one file per pipeline stage, one more for the frozen tensors of `hf_files`' safetensors, and an index when
    there are several) and the other files of `hf_files`' directory."""
    from megatron.core import parallel_state

    out_dir = Path(out_dir)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    files = stages + (1 if _frozen_names(hf_files) else 0)  # the frozen tensors come last
    file_name = "model.safetensors" if files == 1 else f"model-{stage + 1:05d}-of-{files:05d}.safetensors"
    writes = parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0
    # Every rank takes part in the export (it gathers TP/EP shards); only the writing rank keeps the whole
    # tensors, in host memory, so the device holds at most one gathered tensor beyond the model.
    tensors, sizes = {}, {}
    for name, tensor in export_hf_weights(model, hf_files):
        sizes[name] = tensor.numel() * tensor.element_size()
        if writes:
            tensors[name] = tensor.to("cpu").contiguous()
    if writes:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(out_dir / file_name), metadata={"format": "pt"})
    weight_files = [None] * stages
    torch.distributed.all_gather_object(
        weight_files, (file_name, sizes), group=parallel_state.get_pipeline_model_parallel_group()
    )
    if torch.distributed.get_rank() == 0:
        _copy_hf_files(hf_files.directory, out_dir)
        if files > stages:
            frozen_file = f"model-{files:05d}-of-{files:05d}.safetensors"
            weight_files.append((frozen_file, _save_frozen_tensors(hf_files, out_dir / frozen_file)))
        if files > 1:
            weight_map = {name: file for file, sizes in weight_files for name in sizes}
            total_size = sum(size for _, sizes in weight_files for size in sizes.values())
            index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    torch.distributed.barrier()


def checkpoint_to_hf(checkpoint_dir: str | Path, out_dir: str | Path) -> None:
    """Convert an actor checkpoint's model to an HF directory that transformers loads, in the dtype the actor's
    parameters had (bf16 under --bf16; the weights the engines got).

    Builds the model in the current model-parallel layout (megatron's parallel_state must be initialised;
    one process with TP=PP=1 is enough: dist_checkpointing reshards), loads the checkpoint's weights and
    writes them with save_hf.
    """
    from megatron.core import dist_checkpointing, parallel_state

    checkpoint_dir = Path(checkpoint_dir)
    hf_files = read_hf_checkpoint(checkpoint_dir / HF_FILES_DIR)
    with _reading(checkpoint_dir):
        # Megatron gives every parameter the one params_dtype; the optimizer's fp32 copies are "optimizer.*".
        metadata = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
        dtype = metadata["embedding.word_embeddings.weight"].dtype
    config = transformer_config(
        hf_files,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_cpu_initialization=True,
        perform_initialization=False,
    )
    model = build_gpt_model(hf_files, config)
    with _reading(checkpoint_dir):
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(checkpoint_dir))
        model.load_state_dict(state["model"])
    save_hf(model, hf_files, out_dir)


class CheckpointReadError(ValueError):
    """A checkpoint's tensors cannot be read into the model of its config.json; the message is one line."""


@contextmanager
def _reading(checkpoint_dir: Path):
    """Any failure to read `checkpoint_dir`'s tensors (a missing or truncated shard, a shape its config.json does
    not give) as one CheckpointReadError. torch's CheckpointException (a BaseException) carries each rank's own
    exception, with its traceback in the message."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException) as error:
        cause = next(iter(error.failures.values()))[0] if isinstance(error, CheckpointException) else error
        lines = str(cause).strip().splitlines()
        raise CheckpointReadError(
            f"cannot read the model's tensors in checkpoint {checkpoint_dir} ({type(cause).__name__}"
            f"{': ' + lines[0] if lines else ''}): it is incomplete, corrupt, or not of the model in its "
            f"{HF_FILES_DIR}/config.json"
        ) from error
