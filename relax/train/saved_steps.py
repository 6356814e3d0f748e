"""The step directories of a --save directory: their names, when one is complete, which one --load names, and
whether its actor fits a model. The run writes them (relax.run.state.save); a resumed run and `relax convert`
read them.

Layout of a --save directory:

    SAVE/step_000003/actor/     the actor's sharded Megatron checkpoint: model, optimizer, LR scheduler,
                                each rank's RNG states (relax.train.checkpoint)
    SAVE/step_000003/run.json   the loop's own state: the next step, the prompt loader's state, the seed,
                                and the size of every file of actor/ as saved
    SAVE/latest                 the name of the newest complete step directory

step_N holds the state after step N (the `step` of metrics.jsonl). A save writes step_N.partial, renames it
to step_N when everything is in, then replaces `latest` (both renames are atomic): a save that crashes halfway
leaves only a .partial directory, which --load never takes and the next save of that step replaces.
--load takes a --save directory (its `latest`) or one step directory. A step directory damaged after its save
(a file deleted or truncated: its size differs from run.json's) is incomplete: --load of the --save directory
then takes the newest complete step before `latest`'s, with a warning naming the damaged one; --load of the
damaged step directory itself is refused.
"""

import json
from pathlib import Path

from relax.console import say
from relax.hf_checkpoint import HFCheckpointError, read_hf_checkpoint

LATEST = "latest"
PARTIAL_SUFFIX = ".partial"  # a step directory while it is written
RUN_STATE_FILE = "run.json"
ACTOR_DIR = "actor"


class CheckpointError(ValueError):
    """--load names something that is not a resumable checkpoint of this run; the message says why and the fix."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def saved_files(directory: Path) -> dict[str, int]:
    """The size of every file under directory/actor, by its path relative to directory."""
    files = sorted(path for path in (directory / ACTOR_DIR).rglob("*") if path.is_file())
    return {str(path.relative_to(directory)): path.stat().st_size for path in files}


def checkpoint_problem(directory: Path) -> str | None:
    """What makes a step directory unfit to resume from (a save that never finished, or files deleted or truncated
    since), or None when it holds everything its save wrote, at the sizes written."""
    try:
        state = json.loads((directory / RUN_STATE_FILE).read_text())
    except FileNotFoundError:
        return f"missing {directory / RUN_STATE_FILE}"
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{directory / RUN_STATE_FILE} is not the JSON a save writes (truncated?)"
    if "files" not in state:
        return f"{directory / RUN_STATE_FILE} lists no saved files (a save of an earlier relax version)"
    for name, size in state["files"].items():
        path = directory / name
        if not path.is_file():
            return f"missing {path}"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} when saved (truncated?)"
    return None


def step_directory(load: Path, step: int | None = None) -> Path:
    """The step directory --load names: `load` itself, its step `step`, or its newest complete one
    (newest_complete_step)."""
    if not load.is_dir():
        raise CheckpointError(f"--load {load}: no such directory; pass a directory written by --save")
    if step is not None:
        directory = load / step_dir_name(step)
        if not directory.is_dir():
            saved = sorted(p.name for p in load.glob("step_*") if not p.name.endswith(PARTIAL_SUFFIX))
            raise CheckpointError(
                f"--load {load}: no step {step} there ({directory.name} does not exist); saved steps: "
                f"{', '.join(saved) or 'none'}"
            )
        return directory
    if (load / RUN_STATE_FILE).is_file() or (load / ACTOR_DIR).is_dir():
        return load
    if (load / LATEST).is_file():
        return newest_complete_step(load)
    raise CheckpointError(
        f"--load {load}: no checkpoint there (neither {LATEST} nor {RUN_STATE_FILE}; a save that did not finish "
        f"writes no {LATEST}); pass the --save directory of a run or one of its step_* directories"
    )


def newest_complete_step(save_dir: Path) -> Path:
    """The step directory `latest` names when it is complete (checkpoint_problem), else the newest complete one
    before it, with a warning on stderr naming each one passed over and why. Never a step after `latest`'s: such
    a directory is left from a run that went further before this one resumed from an earlier step."""
    named = save_dir / (save_dir / LATEST).read_text().strip()
    named_step = _step_number(named)
    earlier = sorted(
        (path for path in save_dir.glob("step_*") if path.is_dir() and _step_number(path) is not None
         and (named_step is None or _step_number(path) < named_step)),
        key=_step_number, reverse=True,
    )
    passed_over = []
    for directory in [named, *earlier]:
        problem = checkpoint_problem(directory)
        if problem is None:
            for bad, why in passed_over:
                say(f"relax: warning: checkpoint {bad} is incomplete ({why}); resuming from {directory} instead",
                    error=True)
            return directory
        passed_over.append((directory, problem))
    raise CheckpointError(
        f"--load {save_dir}: no complete checkpoint there ({'; '.join(why for _, why in passed_over)}); "
        "drop --load to start from --hf-checkpoint"
    )


def _step_number(directory: Path) -> int | None:
    """N of a step_N directory's name; None for anything else (a .partial directory among them)."""
    digits = directory.name.removeprefix("step_")
    return int(digits) if directory.name.startswith("step_") and digits.isdigit() else None


def check_same_architecture(actor_dir: Path, hf_checkpoint: Path, load) -> None:
    """The actor is built from --hf-checkpoint's config.json; the checkpoint's tensors must fit it."""
    from relax.train.checkpoint import HF_FILES_DIR  # imports torch: only when a checkpoint is checked

    def architecture(directory: Path) -> dict:
        try:
            return read_hf_checkpoint(directory).architecture
        except HFCheckpointError as error:
            raise CheckpointError(f"--load {load}: {error}") from error

    saved = architecture(actor_dir / HF_FILES_DIR)
    current = architecture(hf_checkpoint)
    differences = [f"{key}: {saved[key]!r} vs {current.get(key)!r}" for key in saved if saved[key] != current.get(key)]
    if differences:
        raise CheckpointError(
            f"--load {load}: the checkpoint's model differs from --hf-checkpoint {hf_checkpoint} "
            f"(checkpoint vs --hf-checkpoint: {'; '.join(differences)}); pass the --hf-checkpoint the run started from"
        )
