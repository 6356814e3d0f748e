"""What a run saves at the end of a step and resumes from (--save, --save-interval, --load), and how the
`relax train` driver stops on SIGINT / SIGTERM.

The --save directory's step directories, and how --load finds one: relax.train.saved_steps.

With --save-hf HF, each save also writes the actor's weights as an HF directory HF/step_000003 (safetensors
under HF names, --hf-checkpoint's config, tokenizer and generation config, and the tensors the actor does not
train), which transformers and SGLang load; `relax convert` makes the same directory from a step directory later.

On several nodes, --save and --save-hf must be directories every training rank and the driver see (a shared
filesystem): the ranks write the actor's shards, and the first rank of each pipeline stage its stage's HF
safetensors file.

What a resumed run repeats exactly: the data order (the loader's state), the actor's weights, optimizer,
scheduler and RNG states, and the rollouts' sampling seeds, which derive from (--seed, step) alone
(sampling_seed). SGLang honours per-request seeds only with --sglang-enable-deterministic-inference; without
it a resumed run samples differently from the original from its first step on.
"""

import json
import os
import random
import shutil
import signal
import typing
from dataclasses import dataclass
from pathlib import Path

from relax.console import say
from relax.files import write_text_atomically
from relax.train.saved_steps import (
    ACTOR_DIR, LATEST, PARTIAL_SUFFIX, RUN_STATE_FILE, CheckpointError, check_same_architecture, checkpoint_problem,
    saved_files, step_directory, step_dir_name,
)

if typing.TYPE_CHECKING:  # annotations only
    from relax.args.settings import OutputSettings
    from relax.ray.watch import Timeout


def save_due(outputs: "OutputSettings", num_steps: int, step: int) -> bool:
    """Save after this step? Every --save-interval steps and after the last step, when --save is set."""
    if outputs.save is None:
        return False
    return step == num_steps - 1 or (outputs.save_interval is not None and (step + 1) % outputs.save_interval == 0)


def sampling_seed(seed: int, step: int) -> int:
    """The first per-request sampling seed of a step's rollout: a function of (--seed, step) only, so a resumed
    run samples what the original did. The step's requests use this seed + an offset below 2**24 (their index
    within the step's generate call, plus the dynamic-sampling round's offset); SGLang takes seeds below 2**63."""
    return random.Random(f"{seed}:sampling:{step}").getrandbits(38) << 24


def save(
    save_dir: str | Path, step: int, trainers, loader, seed: int, save_hf: str | Path | None = None,
    timeout: "Timeout | None" = None,
) -> Path:
    """Save the state after `step`: the actor's checkpoint (collective over the training ranks, which must be
    awake), then the loop's state; with `save_hf` (--save-hf), the actor's weights as an HF directory
    save_hf/step_N; then `latest`. The step counts as saved (for --load and a restart) only once its HF directory
    is written too, so a rank that dies in the export has the step redone, export included. Returns the step
    directory. `timeout` (--train-timeout) bounds each call on the ranks."""
    directory = _fresh_partial(Path(save_dir), step)
    trainers.run("save_checkpoint", str(directory / ACTOR_DIR), step, timeout=timeout)
    state = {
        "next_step": step + 1, "seed": seed, "loader": loader.state_dict() if loader is not None else None,
        "files": saved_files(directory),
    }
    write_text_atomically(directory / RUN_STATE_FILE, json.dumps(state, indent=2) + "\n")
    if save_hf is not None:
        hf_directory = _fresh_partial(Path(save_hf), step)
        trainers.run("save_hf", str(hf_directory), timeout=timeout)
        _complete(hf_directory)
    directory = _complete(directory)
    write_text_atomically(Path(save_dir) / LATEST, directory.name + "\n")
    return directory


def _fresh_partial(parent: Path, step: int) -> Path:
    """An empty parent/step_N.partial to write step N's directory into (a save that did not finish left one)."""
    partial = parent / (step_dir_name(step) + PARTIAL_SUFFIX)
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    return partial


def _complete(partial: Path) -> Path:
    """Rename a written step_N.partial to step_N, replacing a step_N saved before (by the run this one resumes)."""
    directory = partial.with_name(partial.name.removesuffix(PARTIAL_SUFFIX))
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(partial, directory)
    return directory


@dataclass(frozen=True)
class Checkpoint:
    directory: Path  # one step directory
    next_step: int
    seed: int
    loader_state: dict

    @property
    def actor_dir(self) -> Path:
        return self.directory / ACTOR_DIR

    def loader(self, prompts):
        """The prompt loader where the checkpointed run left it."""
        from relax.rollout.data import PromptLoader

        if self.loader_state is None:
            raise CheckpointError(
                f"checkpoint {self.directory} was made on replayed rollouts (--load-rollout-data) and has no prompt "
                "loader position; resume it with --load-rollout-data too"
            )
        return PromptLoader.from_state_dict(prompts, self.loader_state)


def read_checkpoint(
    load: str | Path, hf_checkpoint: str | Path, seed: int, num_steps: int, finished_ok: bool = False
) -> Checkpoint:
    """The checkpoint --load names, checked against this run before anything starts: it is complete, made with
    the same --seed, from a model of the same architecture as --hf-checkpoint, and has steps left to run.
    `finished_ok`: a checkpoint after the last step is taken too (a run restarted after its final save, where
    what remains is the evaluation after the last step; relax.run.loop.run_with_restarts)."""
    directory = step_directory(Path(load))
    problem = checkpoint_problem(directory)
    if problem is not None:
        raise CheckpointError(
            f"--load {load}: checkpoint {directory} is incomplete ({problem}); "
            f"load an earlier step directory of {directory.parent}, or drop --load to start from --hf-checkpoint"
        )
    state = json.loads((directory / RUN_STATE_FILE).read_text())
    actor_dir = directory / ACTOR_DIR
    if state["seed"] != seed:
        raise CheckpointError(
            f"--load {load}: the checkpoint was made with --seed {state['seed']}, this run has --seed {seed}; "
            f"resume with --seed {state['seed']} (the data order and sampling seeds derive from it)"
        )
    if state["next_step"] > num_steps or (state["next_step"] == num_steps and not finished_ok):
        raise CheckpointError(
            f"--load {load}: the checkpoint is after step {state['next_step'] - 1} and --num-steps is {num_steps}: "
            f"nothing is left to run; raise --num-steps above {state['next_step']}"
        )
    check_same_architecture(actor_dir, Path(hf_checkpoint), load)
    return Checkpoint(directory, state["next_step"], state["seed"], state["loader"])


# --- stopping on a signal ----------------------------------------------------------------------------------


class RunStopped(Exception):
    """The run stopped early on a signal; `relax train` exits with 128 + signum."""

    def __init__(self, signum: int, last_step: int | None, saved: Path | None):
        self.signum, self.last_step, self.saved = signum, last_step, saved
        done = "before its first step ended" if last_step is None else f"after step {last_step}"
        where = f"; checkpoint in {saved}" if saved else ("; no --save, nothing saved" if last_step is not None else "")
        super().__init__(f"stopped by {signal.Signals(signum).name} {done}{where}")


class StopOnSignal:
    """SIGINT / SIGTERM in the driver. The first signal lets the current step finish (so the run ends on a
    consistent state that can be saved: a half-done step has rolled out and perhaps trained on data whose
    loader position and weights no checkpoint can describe); the loop asks `requested` after each step. A
    second signal abandons the step at once (KeyboardInterrupt); either way the loop's cleanup runs."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum: int | None = None
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt(f"second {signal.Signals(signum).name}: abandoning the step")
        self.signum = signum
        say(
            f"relax train: {signal.Signals(signum).name} received; finishing the current step, then saving (if --save) "
            "and stopping; send it again to stop at once without saving",
            error=True,
        )

    def __enter__(self):
        for signum in self.SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def take_back(self) -> None:
        """Install the handlers again if entered: ray.init replaces the driver's SIGTERM handler (with one that
        calls sys.exit at once)."""
        for signum in self._previous:
            signal.signal(signum, self._handle)

    def __exit__(self, *exc):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        return False
