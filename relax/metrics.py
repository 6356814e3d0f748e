"""Per-step metrics of a run: a progress bar, metrics.jsonl, TensorBoard events, optional wandb, and a
reward-curve PNG at the end. All files go to the run's output directory."""

import json
import math
from pathlib import Path

REWARD_KEY = "rollout/reward_mean"


def extreme(key: str) -> str | None:
    """"max" or "min" for a metric that is an extreme over a batch (its name ends in _max or _min), None for
    the others. Values of one metric from parts of a batch (micro-batches, data-parallel ranks, optimizer
    steps) combine by that extreme; the others are shares that add up, or means that average."""
    for suffix in ("max", "min"):
        if key.endswith(f"_{suffix}"):
            return suffix
    return None


class MetricsLog:
    def __init__(self, output_dir: str | Path, num_steps: int, first_step: int = 0, wandb_project: str | None = None):
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.output_dir / "metrics.jsonl"
        self._jsonl = self.jsonl_path.open("a")
        self._tensorboard = SummaryWriter(str(self.output_dir / "tensorboard"))
        self._progress = tqdm(total=num_steps, initial=first_step, desc="relax", unit="step", dynamic_ncols=True)
        self._wandb = None
        if wandb_project:
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(self.output_dir))

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
        return plot_reward_curve(self.jsonl_path, self.output_dir / "reward_curve.png")


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
