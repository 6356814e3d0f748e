"""`relax convert`: an actor checkpoint written by `relax train --save` to an HF directory, on the CPU.

The output is what --save-hf writes during a run: safetensors under HF names (in the dtype the actor trained
in), the config, tokenizer and generation config of the model the run started from, and the tensors the actor
does not train (a Qwen3.5 vision-language checkpoint's vision tower and MTP head), all kept in the checkpoint.
One process, no Ray cluster and no accelerator: the checkpoint's shards are resharded to one rank.
"""

import argparse
import sys
import tempfile
from pathlib import Path


class ConvertError(ValueError):
    """The input cannot be converted; the message names it and the fix."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="relax convert", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--load", metavar="DIR", required=True,
        help="A --save directory (its newest step, or --step) or one of its step_* directories.",
    )
    parser.add_argument("--step", type=int, metavar="N", help="Convert step N of the --save directory --load names.")
    parser.add_argument(
        "--hf-checkpoint", metavar="DIR",
        help="The HF model the run started from: the checkpoint's model is checked against it (optional; the "
        "checkpoint holds its own copy of the non-weight files).",
    )
    parser.add_argument("--out", metavar="DIR", required=True, help="The HF directory to write (new or empty).")
    args = parser.parse_args(argv)
    try:
        actor_dir = checked_input(Path(args.load), args.step, args.hf_checkpoint, Path(args.out))
        convert(actor_dir, Path(args.out))
    except ConvertError as error:
        print(f"relax convert: {error}", file=sys.stderr)
        return 2
    print(f"relax convert: {actor_dir.parent} -> {args.out}")
    return 0


def checked_input(load: Path, step: int | None, hf_checkpoint: str | None, out: Path) -> Path:
    """The actor checkpoint directory to convert, after the checks that need no tensors read."""
    from relax.train.saved_steps import ACTOR_DIR, CheckpointError, check_same_architecture, step_directory
    from relax.train.checkpoint import HF_FILES_DIR

    try:
        actor_dir = step_directory(load, step) / ACTOR_DIR
        needed = (actor_dir / "metadata.json", actor_dir / HF_FILES_DIR / "config.json")
        missing = [str(path) for path in needed if not path.is_file()]
        if missing:
            raise ConvertError(
                f"--load {load}: {actor_dir} is not a complete actor checkpoint (missing {', '.join(missing)}); "
                "pass a step directory that `relax train --save` finished"
            )
        if hf_checkpoint is not None:
            if not (Path(hf_checkpoint) / "config.json").is_file():
                raise ConvertError(f"--hf-checkpoint {hf_checkpoint}: no config.json there; pass an HF model directory")
            check_same_architecture(actor_dir, Path(hf_checkpoint), load)
    except CheckpointError as error:
        raise ConvertError(str(error)) from error
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError(f"--out {out} exists and is not an empty directory; choose a new one")
    return actor_dir


def convert(actor_dir: Path, out: Path) -> None:
    """checkpoint_to_hf in this process as a world of one CPU rank (gloo, megatron's model parallelism 1)."""
    import torch

    from relax.platform import get_platform

    get_platform("cpu").prepare_megatron()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from relax.train.checkpoint import CheckpointReadError, checkpoint_to_hf

    with tempfile.TemporaryDirectory() as rendezvous:  # a file store: no port to find
        torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}/store", rank=0, world_size=1)
        try:
            parallel_state.initialize_model_parallel()
            model_parallel_cuda_manual_seed(0)
            checkpoint_to_hf(actor_dir, out)
        except CheckpointReadError as error:
            raise ConvertError(str(error)) from error
        finally:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
