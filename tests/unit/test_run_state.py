"""relax.run.state and relax.train.saved_steps without the stack: when saves are due, the sampling seeds, how
--load finds (and refuses) checkpoints, what `relax convert` refuses before reading tensors, and the driver's
signal handling. The checkpoints here are directories with the files a save writes, not real actor checkpoints
(tests/e2e/test_loop_resume.py saves and loads real ones; tests/e2e/test_train_megatron.py converts one)."""

import json
import os
import shutil
import signal
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from relax.args import OutputSettings
from relax.run.state import RunStopped, StopOnSignal, read_checkpoint, sampling_seed, save, save_due
from relax.train.saved_steps import LATEST, PARTIAL_SUFFIX, CheckpointError, saved_files, step_dir_name
from relax.tools.convert import checked_input
from relax.tools.convert import main as convert_main
from relax.tools.tiny_model import build_tiny_model


def test_saves_are_due_every_interval_and_at_the_last_step():
    outputs = OutputSettings(output_dir="out", wandb_project=None, save="ckpt", save_interval=3, save_hf=None)
    assert [step for step in range(8) if save_due(outputs, 8, step)] == [2, 5, 7]
    assert [step for step in range(8) if save_due(replace(outputs, save_interval=None), 8, step)] == [7]
    assert not any(save_due(replace(outputs, save=None), 8, step) for step in range(8))


def test_sampling_seeds_depend_on_seed_and_step_only():
    assert sampling_seed(1234, 5) == sampling_seed(1234, 5)
    seeds = {sampling_seed(1234, step) for step in range(1000)} | {sampling_seed(7, step) for step in range(1000)}
    assert len(seeds) == 2000
    # A step's requests use seed + index; the next step's seeds must not overlap them.
    assert all(seed % 2**24 == 0 and 0 <= seed < 2**63 for seed in seeds)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return build_tiny_model(root / "model", "qwen3"), build_tiny_model(root / "wider", "qwen3", hidden_size=96)


def fake_save(save_dir, step, model_dir, seed=1234, complete=True):
    """The files a save writes after `step` (an empty dist-checkpoint metadata stands for the actor's tensors);
    not complete: as a save that crashed before its end leaves them."""
    directory = save_dir / (step_dir_name(step) + ("" if complete else PARTIAL_SUFFIX))
    (directory / "actor" / "hf").mkdir(parents=True)
    shutil.copy(model_dir / "config.json", directory / "actor" / "hf" / "config.json")
    (directory / "actor" / "metadata.json").write_text("{}")
    if complete:
        loader = {"epoch": 0, "index": 8 * (step + 1), "seed": seed, "shuffle": True, "num_prompts": 100}
        state = {"next_step": step + 1, "seed": seed, "loader": loader, "files": saved_files(directory)}
        (directory / "run.json").write_text(json.dumps(state))
        (save_dir / LATEST).write_text(directory.name + "\n")
    return directory


def test_load_takes_the_latest_complete_step_or_a_named_step(tmp_path, models):
    model, _ = models
    first = fake_save(tmp_path, 1, model)
    fake_save(tmp_path, 3, model)
    fake_save(tmp_path, 5, model, complete=False)  # a save that crashed: `latest` still names step 3
    checkpoint = read_checkpoint(tmp_path, model, seed=1234, num_steps=10)
    assert (checkpoint.directory.name, checkpoint.next_step, checkpoint.loader_state["index"]) == ("step_000003", 4, 32)
    assert read_checkpoint(first, model, seed=1234, num_steps=10).next_step == 2


def test_load_refuses_what_it_cannot_resume_naming_the_path_and_the_fix(tmp_path, models):
    model, wider = models
    with pytest.raises(CheckpointError, match=f"--load {tmp_path / 'none'}: no such directory"):
        read_checkpoint(tmp_path / "none", model, seed=1234, num_steps=10)
    with pytest.raises(CheckpointError, match=f"--load {tmp_path}: no checkpoint there .* its step_. directories"):
        read_checkpoint(tmp_path, model, seed=1234, num_steps=10)
    unfinished = fake_save(tmp_path / "crashed", 2, model, complete=False)
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        read_checkpoint(tmp_path / "crashed", model, seed=1234, num_steps=10)
    with pytest.raises(CheckpointError, match=f"checkpoint {unfinished} is incomplete .*run.json"):
        read_checkpoint(unfinished, model, seed=1234, num_steps=10)

    fake_save(tmp_path / "saves", 3, model)
    with pytest.raises(CheckpointError, match="differs from --hf-checkpoint .*hidden_size: 64 vs 96.* started from"):
        read_checkpoint(tmp_path / "saves", wider, seed=1234, num_steps=10)
    with pytest.raises(CheckpointError, match="made with --seed 1234, this run has --seed 5; resume with --seed 1234"):
        read_checkpoint(tmp_path / "saves", model, seed=5, num_steps=10)
    with pytest.raises(CheckpointError, match="after step 3 and --num-steps is 4: .* raise --num-steps above 4"):
        read_checkpoint(tmp_path / "saves", model, seed=1234, num_steps=4)


def test_a_restart_takes_a_checkpoint_after_the_last_step_and_nothing_later(tmp_path, models):
    model, _ = models
    fake_save(tmp_path, 3, model)  # the last step of a 4-step run: what remains is the evaluation after it
    assert read_checkpoint(tmp_path, model, seed=1234, num_steps=4, finished_ok=True).next_step == 4
    with pytest.raises(CheckpointError, match="after step 3 and --num-steps is 3"):
        read_checkpoint(tmp_path, model, seed=1234, num_steps=3, finished_ok=True)


class ActorSaves:
    """Stands in for the training actors' group: `run("save_checkpoint", dir, step)` writes what a real save
    writes there (an empty dist-checkpoint metadata, the HF config), or fails like a crash mid-save;
    `run("save_hf", dir)` writes the HF config there."""

    def __init__(self, model_dir):
        self.model_dir, self.fail, self.fail_hf = model_dir, False, False

    def run(self, method, directory, step=None, timeout=None):
        if method == "save_hf":
            if self.fail_hf:
                raise RuntimeError("a training rank died in the HF export")
            shutil.copy(self.model_dir / "config.json", Path(directory) / "config.json")
            return []
        assert method == "save_checkpoint"
        (Path(directory) / "hf").mkdir(parents=True)
        shutil.copy(self.model_dir / "config.json", Path(directory) / "hf" / "config.json")
        if self.fail:
            raise RuntimeError("a training rank died mid-save")
        (Path(directory) / "metadata.json").write_text("{}")
        return []


def test_a_save_is_taken_only_once_complete_and_a_crashed_one_is_replaced(tmp_path, models, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # ActorSaves works in this process
    model, _ = models
    loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "index": 16, "seed": 1234, "shuffle": True,
                                                 "num_prompts": 100})
    actors = ActorSaves(model)
    assert save(tmp_path, 1, actors, loader, seed=1234) == tmp_path / "step_000001"

    actors.fail = True
    with pytest.raises(RuntimeError, match="mid-save"):
        save(tmp_path, 3, actors, loader, seed=1234)
    assert (tmp_path / ("step_000003" + PARTIAL_SUFFIX)).is_dir() and not (tmp_path / "step_000003").exists()
    assert read_checkpoint(tmp_path, model, seed=1234, num_steps=10).next_step == 2  # still the last complete one

    actors.fail = False
    save(tmp_path, 3, actors, loader, seed=1234)
    save(tmp_path, 3, actors, loader, seed=1234)  # saved again: a resumed run writing into the same directory
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, "step_000001", "step_000003"]
    checkpoint = read_checkpoint(tmp_path, model, seed=1234, num_steps=10)
    assert (checkpoint.next_step, checkpoint.loader_state["index"]) == (4, 16)


def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before_with_a_warning(
    tmp_path, models, monkeypatch, capsys
):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # ActorSaves works in this process
    model, _ = models
    loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "index": 16})
    for step in (1, 2, 3, 4):
        save(tmp_path, step, ActorSaves(model), loader, seed=1234)
    (tmp_path / LATEST).write_text("step_000003\n")  # as after a resume from step 3: step 4 is another run's
    config = tmp_path / "step_000003" / "actor" / "hf" / "config.json"
    config.write_bytes(config.read_bytes()[:10])  # truncated since its save
    (tmp_path / "step_000002" / "actor" / "metadata.json").unlink()

    assert read_checkpoint(tmp_path, model, seed=1234, num_steps=10).next_step == 2  # step 1's, never step 4's
    warnings = capsys.readouterr().err.splitlines()
    assert len(warnings) == 2 and all(line.startswith("relax: warning: checkpoint ") for line in warnings), warnings
    assert f"{config} has 10 bytes, {(model / 'config.json').stat().st_size} when saved" in warnings[0]
    assert f"missing {tmp_path / 'step_000002' / 'actor' / 'metadata.json'}" in warnings[1]
    assert all(line.endswith(f"resuming from {tmp_path / 'step_000001'} instead") for line in warnings)
    # The damaged step directory named itself is refused, naming what is wrong.
    with pytest.raises(CheckpointError, match="checkpoint .*step_000003 is incomplete .*config.json has 10 bytes"):
        read_checkpoint(tmp_path / "step_000003", model, seed=1234, num_steps=10)

    (tmp_path / "step_000001" / "run.json").write_text('{"next_step": 2, "se')  # truncated
    shutil.rmtree(tmp_path / "step_000004")
    (tmp_path / LATEST).write_text("step_000004\n")  # names a directory that is gone
    with pytest.raises(CheckpointError, match="no complete checkpoint there .*step_000004.* is not the JSON"):
        read_checkpoint(tmp_path, model, seed=1234, num_steps=10)


def test_a_save_with_save_hf_writes_the_hf_directory_of_the_step(tmp_path, models, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "get", lambda refs: refs)  # ActorSaves works in this process
    model, _ = models
    loader = SimpleNamespace(state_dict=lambda: {"epoch": 0, "index": 16})
    save(tmp_path / "checkpoints", 1, ActorSaves(model), loader, seed=1234, save_hf=tmp_path / "hf")
    save(tmp_path / "checkpoints", 1, ActorSaves(model), loader, seed=1234, save_hf=tmp_path / "hf")  # resumed
    assert [p.name for p in (tmp_path / "hf").iterdir()] == ["step_000001"]
    assert (tmp_path / "hf" / "step_000001" / "config.json").read_text() == (model / "config.json").read_text()
    # A rank that dies in step 3's export leaves step 3 unsaved: a restart resumes after step 1 and redoes the export.
    dying = ActorSaves(model)
    dying.fail_hf = True
    with pytest.raises(RuntimeError, match="HF export"):
        save(tmp_path / "checkpoints", 3, dying, loader, seed=1234, save_hf=tmp_path / "hf")
    assert read_checkpoint(tmp_path / "checkpoints", model, seed=1234, num_steps=10).next_step == 2
    assert not (tmp_path / "checkpoints" / "step_000003").exists() and not (tmp_path / "hf" / "step_000003").exists()


def test_convert_takes_the_latest_or_a_named_step(tmp_path, models):
    model, _ = models
    fake_save(tmp_path / "saves", 1, model)
    fake_save(tmp_path / "saves", 3, model)
    out = tmp_path / "out"
    assert checked_input(tmp_path / "saves", None, str(model), out) == tmp_path / "saves" / "step_000003" / "actor"
    assert checked_input(tmp_path / "saves", 1, None, out) == tmp_path / "saves" / "step_000001" / "actor"


def test_convert_refuses_in_one_line_what_it_cannot_convert(tmp_path, models, capsys):
    model, wider = models
    saves = tmp_path / "saves"
    fake_save(saves, 1, model)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    (saves / "step_000002" / "actor").mkdir(parents=True)  # a step directory without the actor's tensors
    refusals = {
        f"--load {tmp_path / 'none'}: no such directory": ["--load", str(tmp_path / "none")],
        f"--load {saves}: no step 5 there (step_000005 does not exist); saved steps: step_000001, step_000002": [
            "--load", str(saves), "--step", "5",
        ],
        f"{saves / 'step_000002' / 'actor'} is not a complete actor checkpoint (missing": [
            "--load", str(saves), "--step", "2",
        ],
        "the checkpoint's model differs from --hf-checkpoint": ["--load", str(saves), "--hf-checkpoint", str(wider)],
        f"--out {tmp_path / 'full'} exists and is not an empty directory": [
            "--load", str(saves), "--out", str(tmp_path / "full"),
        ],
    }
    for message, argv in refusals.items():
        argv = argv if "--out" in argv else [*argv, "--out", str(tmp_path / "out")]
        assert convert_main(argv) == 2
        errors = capsys.readouterr().err.splitlines()
        assert len(errors) == 1 and errors[0].startswith("relax convert: ") and message in errors[0], errors


def test_first_signal_asks_to_stop_second_abandons_and_handlers_are_restored(capsys):
    before = signal.getsignal(signal.SIGTERM)
    StopOnSignal().take_back()  # not entered: installs nothing
    assert signal.getsignal(signal.SIGTERM) is before
    with StopOnSignal() as stop:
        assert not stop.requested
        signal.signal(signal.SIGTERM, lambda *_: None)  # as ray.init does in a driver
        stop.take_back()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.signum == signal.SIGTERM
        assert "SIGTERM received; finishing the current step" in capsys.readouterr().err
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before
    assert str(RunStopped(signal.SIGTERM, 4, None)) == "stopped by SIGTERM after step 4; no --save, nothing saved"
    assert str(RunStopped(signal.SIGINT, None, None)) == "stopped by SIGINT before its first step ended"


def test_a_vision_language_checkpoint_is_compared_by_its_language_model(tmp_path):
    model = build_tiny_model(tmp_path / "vl", "qwen3_5_vl")
    wider = build_tiny_model(tmp_path / "vl_wider", "qwen3_5_vl", hidden_size=96)
    fake_save(tmp_path / "saves", 1, model)
    assert read_checkpoint(tmp_path / "saves", model, seed=1234, num_steps=4).next_step == 2
    with pytest.raises(CheckpointError, match="hidden_size: 64 vs 96"):
        read_checkpoint(tmp_path / "saves", wider, seed=1234, num_steps=4)
