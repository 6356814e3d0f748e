"""Per-step metrics of a run: a progress bar, metrics.jsonl, TensorBoard events, optional wandb, and a
reward-curve PNG at the end. All files go to the run's output directory.

One run, one record: the files of an output directory describe one run. A new run does not start where an
earlier run's record is (`relax train` refuses it, naming --overwrite-output-dir, which replaces that
record); a run resumed with --load continues its record from the checkpoint's step, dropping the rows of
any later steps the earlier process logged after saving (the resumed run redoes those steps).
"""

import json
import math
import shutil
from pathlib import Path

from relax.files import write_text_atomically

REWARD_KEY = "rollout/reward_mean"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
REWARD_CURVE_FILE = "reward_curve.png"
RECORD = (METRICS_FILE, TENSORBOARD_DIR, REWARD_CURVE_FILE)  # what a run writes to its output directory


def earlier_record(output_dir: str | Path) -> list[str]:
    """The names of the record files an earlier run left in output_dir."""
    return [name for name in RECORD if (Path(output_dir) / name).exists()]


class MetricsLog:
    def __init__(self, output_dir: str | Path, num_steps: int, first_step: int = 0, wandb_project: str | None = None):
        """The record of a run that starts at `first_step`: 0 for a new run, the checkpoint's next step for a
        resumed one. Steps from first_step on are dropped from an earlier record in output_dir (all of it for a
        new run, which `relax train` lets start there only with --overwrite-output-dir)."""
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / METRICS_FILE
        self._keep_record_before(first_step)
        self._jsonl = self.jsonl_path.open("a")
        # purge_step: TensorBoard hides the earlier events of steps >= first_step (a resumed run logs them anew).
        self._tensorboard = SummaryWriter(str(self.output_dir / TENSORBOARD_DIR), purge_step=first_step or None)
        self._progress = tqdm(total=num_steps, initial=first_step, desc="relax", unit="step", dynamic_ncols=True)
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(self.output_dir))

    def _keep_record_before(self, first_step: int) -> None:
        rows = read_metrics(self.jsonl_path) if self.jsonl_path.exists() else []
        write_text_atomically(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in rows if r["step"] < first_step))
        if first_step == 0:  # a new record: nothing of an earlier run's is kept
            shutil.rmtree(self.output_dir / TENSORBOARD_DIR, ignore_errors=True)
            (self.output_dir / REWARD_CURVE_FILE).unlink(missing_ok=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **{key: float(value) for key, value in metrics.items()}}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for key, value in record.items():
            if key != "step" and math.isfinite(value):
                self._tensorboard.add_scalar(key, value, step)
        self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(metrics, step=step)
        self._progress.set_postfix(
            reward=f"{metrics.get(REWARD_KEY, float('nan')):.3f}",
            step_time=f"{metrics.get('perf/step_time', float('nan')):.1f}s",
        )
        self._progress.update(1)

    def close(self) -> Path:
        """Flush everything and draw the reward curve from metrics.jsonl; returns the PNG's path."""
        self._progress.close()
        self._jsonl.close()
        self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        return plot_reward_curve(self.jsonl_path, self.output_dir / REWARD_CURVE_FILE)


def read_metrics(jsonl_path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(jsonl_path).read_text().splitlines() if line.strip()]


def plot_reward_curve(jsonl_path: str | Path, png_path: str | Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display: write the file only
    import matplotlib.pyplot as plt

    records = [r for r in read_metrics(jsonl_path) if REWARD_KEY in r]
    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot([r["step"] for r in records], [r[REWARD_KEY] for r in records], marker="o", markersize=3)
    axes.set_xlabel("step")
    axes.set_ylabel("mean reward")
    axes.set_ylim(bottom=min(0.0, *(r[REWARD_KEY] for r in records)) if records else 0.0)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(png_path, dpi=100)
    plt.close(figure)
    return Path(png_path)
