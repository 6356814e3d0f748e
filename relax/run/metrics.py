"""Per-step metrics of a run: a progress bar, metrics.jsonl, TensorBoard events, optional wandb; at the end (also
when a signal stops the run) a PNG of reward (with each eval set's pass@1) and response length per step and a
summary on the console. All files go to the run's output directory.

The evaluation after the last step is a row of its own, at step num_steps (relax.rollout.evaluation), with the
engines restarted during it (faults/engine_restarts); every other row is a step's. Every row has
faults/run_restarts: how often the run had restarted when it was logged (relax.run.loop.run_with_restarts).

Besides what the loop logs, each step gets its throughput and the share of the step each phase took
(step_rates); the summary gives the same over the whole record (run_summary). Both are functions of logged rows.

One run, one record: the files of an output directory describe one run. A new run does not start where an
earlier run's record is (`relax train` refuses it, naming --overwrite-output-dir, which replaces that
record); a run resumed with --load continues its record from the checkpoint's step, dropping the rows of
any later steps the earlier process logged after saving (the resumed run redoes those steps).
"""

import json
import math
import re
import shutil
import time
from pathlib import Path

from relax.console import RUN_LOG_FILE, progress_stream, say
from relax.files import write_text_atomically

REWARD_KEY = "rollout/reward_mean"
RUN_RESTARTS = "faults/run_restarts"  # times the run resumed from a checkpoint after a worker failed (--max-restarts)
EVAL_PASS_AT_1 = re.compile(r"eval/(?P<name>.+)/pass@1")  # each eval set's, besides the reward
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
REWARD_CURVE_FILE = "reward_curve.png"
RECORD = (METRICS_FILE, TENSORBOARD_DIR, REWARD_CURVE_FILE, RUN_LOG_FILE)  # what a run writes to its output directory
PHASES = ("rollout", "train_wait", "train", "save", "weight_sync")  # each perf/<phase>_time is part of perf/step_time
# tokens/s. Rollout: the tokens generated for the step's samples per second of rollout (under --dynamic-sampling,
# groups it dropped are not counted); train: the trained sequences' tokens (prompt and response of every sample)
# per second of training.
TOKENS_PER_SECOND = {  # name: (token keys, seconds key, what the summary calls it)
    "perf/rollout_tokens_per_s": (("rollout/response_tokens",), "perf/rollout_time", "rollout (generated)"),
    "perf/train_tokens_per_s": (
        ("rollout/prompt_tokens", "rollout/response_tokens"), "perf/train_time", "train (prompt + response)"
    ),
}


def earlier_record(output_dir: str | Path) -> list[str]:
    """The names of the record files an earlier run left in output_dir."""
    return [name for name in RECORD if (Path(output_dir) / name).exists()]


class MetricsLog:
    def __init__(
        self,
        output_dir: str | Path,
        num_steps: int,
        first_step: int = 0,
        wandb_project: str | None = None,
        other_outputs: dict[str, str | None] | None = None,
        restarts: int = 0,
    ):
        """The record of a run that starts at `first_step`: 0 for a new run, the checkpoint's next step for a
        resumed one. Steps from first_step on are dropped from an earlier record in output_dir (all of it for a
        new run, which `relax train` lets start there only with --overwrite-output-dir). other_outputs: what the
        run writes elsewhere (name -> path, None where it writes nothing), listed in the summary. restarts: how
        often the run restarted before this attempt, in every row (RUN_RESTARTS) and in the summary, also when
        the attempt logs no row (a restart after the final save, with no evaluation after the last step)."""
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self._started = time.monotonic()
        self._restarts = restarts
        self._other_outputs = {name: path for name, path in (other_outputs or {}).items() if path is not None}
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / METRICS_FILE
        self._keep_record_before(first_step)
        self._jsonl = self.jsonl_path.open("a")
        # purge_step: TensorBoard hides the earlier events of steps >= first_step (a resumed run logs them anew).
        self._tensorboard = SummaryWriter(str(self.output_dir / TENSORBOARD_DIR), purge_step=first_step or None)
        self._progress = tqdm(
            total=num_steps, initial=first_step, desc="relax", unit="step", dynamic_ncols=True, file=progress_stream()
        )
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(self.output_dir))

    def _keep_record_before(self, first_step: int) -> None:
        if self.jsonl_path.exists():
            kept = [r for r in read_metrics(self.jsonl_path) if r["step"] < first_step]
            write_text_atomically(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in kept))
        if first_step == 0:  # a new record: nothing of an earlier run's is kept
            shutil.rmtree(self.output_dir / TENSORBOARD_DIR, ignore_errors=True)
            (self.output_dir / REWARD_CURVE_FILE).unlink(missing_ok=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """A step's row."""
        metrics = {key: float(value) for key, value in metrics.items()}
        metrics.update(step_rates(metrics))
        self._write(step, metrics)
        self._progress.set_postfix(
            reward=f"{metrics.get(REWARD_KEY, float('nan')):.3f}",
            step_time=f"{metrics.get('perf/step_time', float('nan')):.1f}s",
        )
        self._progress.update(1)

    def log_evaluation(self, step: int, metrics: dict[str, float]) -> None:
        """The row of the evaluation after the last step: its eval metrics, perf/eval_time and (with engines)
        faults/engine_restarts, and RUN_RESTARTS as every row; no step of the progress bar."""
        self._write(step, {key: float(value) for key, value in metrics.items()})

    def _write(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics, RUN_RESTARTS: float(self._restarts)}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step" and math.isfinite(value):
                self._tensorboard.add_scalar(key, value, step)
        self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log({key: value for key, value in record.items() if key != "step"}, step=step)

    def close(self) -> Path:
        """Flush everything, draw the reward curve from metrics.jsonl and print the run's summary; returns the
        PNG's path."""
        self._progress.close()
        self._jsonl.close()
        self._tensorboard.close()
        outputs = {
            "metrics": self.jsonl_path,
            "tensorboard": self.output_dir / TENSORBOARD_DIR,
            "reward curve": plot_reward_curve(self.jsonl_path, self.output_dir / REWARD_CURVE_FILE),
        }
        if self._wandb is not None:
            outputs["wandb"] = self._wandb.url
            self._wandb.finish()
        if (self.output_dir / RUN_LOG_FILE).exists():  # written by `relax train`'s console (relax.console)
            outputs["console log"] = self.output_dir / RUN_LOG_FILE
        outputs.update(self._other_outputs)
        say(run_summary(read_metrics(self.jsonl_path), time.monotonic() - self._started, outputs, self._restarts))
        return outputs["reward curve"]


def tokens_per_second(rows: list[dict]) -> dict[str, float]:
    """TOKENS_PER_SECOND over the rows that have their keys (all tokens over all seconds)."""
    rates = {}
    for name, (token_keys, seconds_key, _) in TOKENS_PER_SECOND.items():
        usable = [r for r in rows if seconds_key in r and all(key in r for key in token_keys)]
        seconds = sum(r[seconds_key] for r in usable)
        if seconds > 0:
            rates[name] = sum(r[key] for r in usable for key in token_keys) / seconds
    return rates


def phase_shares(rows: list[dict]) -> dict[str, float]:
    """perf/<phase>_share: the phase's part of the time in steps, for each phase the rows time."""
    step_seconds = sum(r.get("perf/step_time", 0.0) for r in rows)
    if step_seconds <= 0:
        return {}
    timed = [phase for phase in PHASES if any(f"perf/{phase}_time" in r for r in rows)]
    return {f"perf/{p}_share": sum(r.get(f"perf/{p}_time", 0.0) for r in rows) / step_seconds for p in timed}


def step_rates(row: dict) -> dict[str, float]:
    """What each step's row gets besides what the loop measured: its tokens/s and its phases' shares."""
    return {**tokens_per_second([row]), **phase_shares([row])}


def run_summary(rows: list[dict], wall_seconds: float, outputs: dict[str, object], restarts: int = 0) -> str:
    """A short table of the run's record: steps, reward, time, time share per phase, tokens/s, engines restarted
    in place (faults/engine_restarts), run restarts (the most of the rows' and `restarts`, the current
    attempt's), outputs."""
    lines = ["relax run summary"]
    step_rows = [r for r in rows if "perf/step_time" in r]  # not the evaluation after the last step
    if step_rows:
        lines.append(f"  steps         {len(step_rows)} (steps {step_rows[0]['step']}-{step_rows[-1]['step']})")
    else:
        lines.append("  steps         none finished")
    for label, key in [("reward", REWARD_KEY), *((f"eval {name} pass@1", key) for name, key in eval_keys(rows))]:
        values = [(r["step"], r[key]) for r in rows if key in r]
        if values:
            best_step, best = max(values, key=lambda step_value: step_value[1])
            lines.append(
                f"  {label:<13} first {values[0][1]:.3f}, last {values[-1][1]:.3f}, best {best:.3f} (step {best_step})"
            )
    step_seconds = sum(r.get("perf/step_time", 0.0) for r in rows)
    wall = f"{_duration(wall_seconds)} from the actors' start; {_duration(step_seconds)} in steps"
    lines.append(f"  wall time     {wall}")
    shares = phase_shares(rows)
    if shares:
        parts = [f"{key[len('perf/'):-len('_share')].replace('_', ' ')} {share:.0%}" for key, share in shares.items()]
        lines.append(f"  time share    {', '.join(parts)}")
    rates = tokens_per_second(rows)
    if rates:
        parts = [f"{TOKENS_PER_SECOND[key][2]} {rate:,.0f}" for key, rate in rates.items()]
        lines.append(f"  tokens/s      {', '.join(parts)}")
    restarted = [r for r in rows if r.get("faults/engine_restarts")]
    if restarted:
        steps = [str(r["step"]) for r in restarted if "perf/step_time" in r]  # the others: the last evaluation
        where = [f"step(s) {', '.join(steps)}"] if steps else []
        if len(steps) < len(restarted):
            where.append("the evaluation after the last step")
        count = sum(int(r["faults/engine_restarts"]) for r in restarted)
        seconds = sum(r.get("faults/engine_restart_seconds", 0.0) for r in restarted)
        lines.append(f"  faults        {count} engine restart(s) ({seconds:.0f} s), in {' and '.join(where)}")
    restarts = max([restarts, *(r.get(RUN_RESTARTS, 0) for r in rows)])
    if restarts:
        lines.append(
            f"  restarts      {restarts:.0f}: resumed from a checkpoint after a training rank or an engine failed"
        )
    lines += [f"  {name:<13} {where}" for name, where in outputs.items()]
    return "\n".join(lines)


def eval_keys(rows: list[dict]) -> list[tuple[str, str]]:
    """(set name, its pass@1 key) of every eval set in the rows, in the order they first appear."""
    found = {}
    for row in rows:
        for key in row:
            if match := EVAL_PASS_AT_1.fullmatch(key):
                found.setdefault(match["name"], key)
    return list(found.items())


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m{seconds:02d}s" if hours else f"{minutes}m{seconds:02d}s"


def read_metrics(jsonl_path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(jsonl_path).read_text().splitlines() if line.strip()]


def plot_reward_curve(jsonl_path: str | Path, png_path: str | Path) -> Path:
    """The mean reward (with each eval set's pass@1) and the mean response length per step, one above the other."""
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    eval_lines = [(key, f"eval {name} pass@1") for name, key in eval_keys(rows)]
    panel_lines = [  # (y label, [(key, line label)])
        ("mean reward" + (" / eval pass@1" if eval_lines else ""), [(REWARD_KEY, "rollout reward"), *eval_lines]),
        ("mean response length (tokens)", [("rollout/response_length_mean", None)]),
    ]
    figure, panels = plt.subplots(2, 1, figsize=(6, 5.5), sharex=True)
    for axes, (y_label, lines) in zip(panels, panel_lines):
        values = [0.0]
        for key, label in lines:
            records = [r for r in rows if key in r]
            axes.plot([r["step"] for r in records], [r[key] for r in records], marker="o", markersize=3, label=label)
            values += [r[key] for r in records]
        if len(lines) > 1:
            axes.legend(fontsize="small")
        axes.set_ylabel(y_label)
        axes.set_ylim(bottom=min(values))
        axes.grid(alpha=0.3)
    panels[-1].set_xlabel("step")
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return Path(png_path)
