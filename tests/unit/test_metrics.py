"""One run, one record: a new run's metrics replace an earlier run's only when asked, and a resumed run continues
its own record from the checkpoint's step (metrics.jsonl, TensorBoard, the reward curve)."""

import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers import DRY_RUN as RUN
from relax.args import parse_train_args
from relax.run.inputs import InputError, read_inputs
from relax.run.metrics import MetricsLog, read_metrics


def read_dry_run_inputs(argv):
    """What `relax train --dry-run` reads and checks before it prints (relax.run.inputs)."""
    return read_inputs(parse_train_args(argv), dry_run=True)


def log_run(output_dir, steps, reward, first_step=0):
    log = MetricsLog(output_dir, num_steps=steps.stop, first_step=first_step)
    for step in steps:
        log.log(step, {"rollout/reward_mean": reward + step / 10})
    return log.close()


def tensorboard_rewards(output_dir) -> list[tuple[int, float]]:
    """(step, reward) as TensorBoard shows them, its restart purge applied."""
    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    return [(e.step, pytest.approx(e.value)) for e in events.Scalars("rollout/reward_mean")]


def test_a_new_record_replaces_an_earlier_one_entirely(tmp_path):
    log_run(tmp_path, range(4), reward=0.0)
    time.sleep(1.1)  # TensorBoard names event files by the second: the second run's must differ to be seen apart
    png = log_run(tmp_path, range(2), reward=0.5)
    assert [(r["step"], r["rollout/reward_mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        (0, 0.5), (1, pytest.approx(0.6))
    ]
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1  # the earlier run's events are gone
    assert tensorboard_rewards(tmp_path) == [(0, 0.5), (1, 0.6)]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_a_resumed_run_continues_its_record_from_the_checkpoint_step(tmp_path):
    """The earlier process logged steps 0-3 but its checkpoint is after step 1: the resumed run redoes 2 and 3."""
    log_run(tmp_path, range(4), reward=0.0)
    time.sleep(1.1)
    log_run(tmp_path, range(2, 5), reward=0.5, first_step=2)
    rows = [(r["step"], r["rollout/reward_mean"]) for r in read_metrics(tmp_path / "metrics.jsonl")]
    expected = [(0, 0.0), (1, pytest.approx(0.1)), (2, pytest.approx(0.7)), (3, pytest.approx(0.8)),
                (4, pytest.approx(0.9))]
    assert rows == expected
    assert tensorboard_rewards(tmp_path) == expected


def test_a_new_run_refuses_an_earlier_record_unless_told_to_overwrite(tmp_path):
    output = tmp_path / "out"
    log_run(output, range(2), reward=0.0)
    argv = [*RUN, "--output-dir", str(output)]
    with pytest.raises(InputError) as refused:
        read_dry_run_inputs(argv)
    assert (
        f"--output-dir {output} holds an earlier run's record (metrics.jsonl, tensorboard, reward_curve.png) and a "
        "new run would mix its steps into it: pass --overwrite-output-dir" in str(refused.value)
    )
    read_dry_run_inputs([*argv, "--overwrite-output-dir"])
    read_dry_run_inputs([*argv, "--load", str(tmp_path / "checkpoints")])  # a resumed run continues its record
    read_dry_run_inputs([*RUN, "--output-dir", str(tmp_path / "fresh")])


def test_a_new_run_refuses_a_save_directory_with_checkpoints(tmp_path):
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000003\n")
    argv = [*RUN, "--output-dir", str(tmp_path / "out"), "--save", str(tmp_path / "checkpoints")]
    with pytest.raises(InputError) as refused:
        read_dry_run_inputs(argv)
    assert f"resume that run with --load {tmp_path / 'checkpoints'}, or choose another --save" in str(refused.value)
    read_dry_run_inputs([*argv, "--load", str(tmp_path / "checkpoints")])


def test_a_new_run_refuses_an_hf_directory_with_earlier_steps(tmp_path):
    (tmp_path / "hf" / "step_000003").mkdir(parents=True)
    argv = [*RUN, "--output-dir", str(tmp_path / "out"), "--save", str(tmp_path / "checkpoints")]
    with pytest.raises(InputError) as refused:
        read_dry_run_inputs([*argv, "--save-hf", str(tmp_path / "hf")])
    assert f"--save-hf {tmp_path / 'hf'} holds an earlier run's HF directories" in str(refused.value)
    read_dry_run_inputs([*argv, "--save-hf", str(tmp_path / "hf"), "--load", str(tmp_path / "checkpoints")])
    read_dry_run_inputs([*argv, "--save-hf", str(tmp_path / "fresh")])


STEP = {
    "rollout/reward_mean": 0.25, "rollout/response_tokens": 600.0, "rollout/prompt_tokens": 400.0,
    "perf/step_time": 10.0, "perf/rollout_time": 3.0, "perf/train_wait_time": 1.0, "perf/train_time": 4.0,
    "perf/weight_sync_time": 2.0,
}


def test_each_step_gets_its_tokens_per_second_and_phase_shares(tmp_path):
    log = MetricsLog(tmp_path, num_steps=1)
    log.log(0, STEP)
    log.close()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row["perf/rollout_tokens_per_s"] == 200.0  # 600 generated tokens in 3 s
    assert row["perf/train_tokens_per_s"] == 250.0  # 1000 prompt + response tokens trained in 4 s
    shares = {key: value for key, value in row.items() if key.endswith("_share")}
    assert shares == {"perf/rollout_share": 0.3, "perf/train_wait_share": 0.1, "perf/train_share": 0.4,
                      "perf/weight_sync_share": 0.2}


def test_the_run_ends_with_a_summary_of_its_record(tmp_path, capsys):
    log = MetricsLog(tmp_path, num_steps=3, other_outputs={"checkpoints": "/ckpt", "rollout data": None})
    for step, reward in enumerate([0.25, 0.75, 0.5]):
        saving = {"perf/save_time": 10.0, "perf/step_time": 20.0} if step == 2 else {}
        log.log(step, {**STEP, "rollout/reward_mean": reward, **saving})
    log.close()
    summary = capsys.readouterr().out
    assert "relax run summary\n  steps         3 (steps 0-2)\n" in summary
    assert "restarts" not in summary
    assert "  reward        first 0.250, last 0.500, best 0.750 (step 1)\n" in summary
    assert "s from the actors' start; 0m40s in steps\n" in summary
    # 40 s in steps: rollout 9 s, train wait 3, train 12, save 10, weight sync 6
    assert "  time share    rollout 22%, train wait 8%, train 30%, save 25%, weight sync 15%\n" in summary
    assert "  tokens/s      rollout (generated) 200, train (prompt + response) 250\n" in summary
    assert f"  metrics       {tmp_path / 'metrics.jsonl'}\n" in summary
    assert f"  reward curve  {tmp_path / 'reward_curve.png'}\n" in summary
    assert "  checkpoints   /ckpt" in summary and "rollout data" not in summary
    assert "faults" not in summary  # no engine was restarted


def test_the_summary_counts_engine_restarts_and_their_steps(tmp_path, capsys):
    log = MetricsLog(tmp_path, num_steps=4)
    for step, restarts in enumerate([0, 2, 0, 1]):
        log.log(step, {**STEP, "rollout/reward_mean": 0.5, "faults/engine_restarts": restarts,
                       "faults/engine_restart_seconds": 20.0 * restarts})
    log.close()
    assert "  faults        3 engine restart(s) (60 s), in step(s) 1, 3\n" in capsys.readouterr().out


def test_engine_restarts_in_the_evaluation_after_the_last_step_reach_its_row_and_the_summary(tmp_path, capsys):
    log = MetricsLog(tmp_path, num_steps=2)
    for step, restarts in enumerate([1, 0]):
        log.log(step, {**STEP, "faults/engine_restarts": restarts})
    log.log_evaluation(2, {"eval/held_out/pass@1": 0.5, "perf/eval_time": 1.0, "faults/engine_restarts": 2})
    log.close()
    assert read_metrics(tmp_path / "metrics.jsonl")[-1]["faults/engine_restarts"] == 2
    assert "  faults        3 engine restart(s) (0 s), in step(s) 0 and the evaluation after the last step\n" in (
        capsys.readouterr().out
    )


def test_every_row_and_the_summary_say_how_often_the_run_restarted(tmp_path, capsys):
    for restarts in range(3):  # each attempt failed after its step: resumed from a checkpoint before steps 1 and 2
        log = MetricsLog(tmp_path, num_steps=3, first_step=restarts, restarts=restarts)
        log.log(restarts, STEP)
        log.close()
    assert [r["faults/run_restarts"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    restarted = "  restarts      {}: resumed from a checkpoint after a training rank or an engine failed\n"
    assert restarted.format(2) in capsys.readouterr().out
    # Restarted after the final save, without an evaluation after the last step: the attempt logs no row.
    MetricsLog(tmp_path, num_steps=3, first_step=3, restarts=3).close()
    assert restarted.format(3) in capsys.readouterr().out


def test_a_run_stopped_before_its_first_step_still_says_where_its_outputs_are(tmp_path, capsys):
    MetricsLog(tmp_path, num_steps=3).close()
    summary = capsys.readouterr().out
    assert "  steps         none finished\n" in summary and f"  tensorboard   {tmp_path / 'tensorboard'}" in summary


def test_eval_scores_reach_the_summary_and_the_curve_and_the_last_evaluation_is_no_step(tmp_path, capsys):
    log = MetricsLog(tmp_path, num_steps=2)
    log.log(0, {**STEP, "eval/held_out/pass@1": 0.25, "eval/held_out/pass@2": 0.5, "eval/aime/pass@1": 0.0})
    log.log(1, STEP)
    log.log_evaluation(2, {"eval/held_out/pass@1": 0.75, "eval/aime/pass@1": 0.125})
    png = log.close()
    summary = capsys.readouterr().out
    assert "  steps         2 (steps 0-1)\n" in summary
    assert "  eval held_out pass@1 first 0.250, last 0.750, best 0.750 (step 2)\n" in summary
    assert "  eval aime pass@1 first 0.000, last 0.125, best 0.125 (step 2)\n" in summary
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
    assert png.read_bytes()[:4] == b"\x89PNG"
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/held_out/pass@1")] == [(0, 0.25), (2, 0.75)]
