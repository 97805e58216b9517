"""metrics.jsonl / eval.jsonl (one JSON object per line, flushed as written), the same rows mirrored to TensorBoard
or wandb (`report_to`), and the reward/accuracy plot."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

from hetrl.schema import InputError
from hetrl.trainer import files
from hetrl.trainer.guards import finite_or_none

# metrics.jsonl keys that measure time (they differ between otherwise identical runs); everything else in a row is
# a function of the config and the seed
TIMING_KEYS = frozenset({"gen_s", "prefill_s", "decode_s", "logprob_s", "update_s", "step_s", "tokens_per_s",
                         "weight_sync_s", "weight_load_s"})


class MetricsLog:
    def __init__(self, path: pathlib.Path, tracker: Tracker | None = None):
        self.path = pathlib.Path(path)
        self.tracker = tracker

    def exists(self) -> bool:
        return self.path.is_file() and self.path.stat().st_size > 0

    def write(self, row: dict) -> None:
        row = finite_or_none(row)      # strict JSON: a non-finite value is null, never NaN text
        files.append_line(self.path, json.dumps(row, allow_nan=False) + "\n")
        if self.tracker is not None:
            self.tracker.log(row)

    def truncate_after(self, step: int) -> None:
        """Drop rows logged after `step` (a resumed run redoes them), keeping the file valid throughout."""
        rows = [r for r in self.read() if r.get("step", 0) <= step]
        files.write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))

    def read(self) -> list[dict]:
        """Rows as written; a last line cut short by a crash mid-write is dropped (it was never complete)."""
        if not self.path.is_file():
            return []
        lines = self.path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                if i == len(lines) - 1:
                    break
                raise ValueError(f"{self.path} line {i + 1} is not JSON; the file was edited or damaged") from None
        return rows


class Tracker:
    """The rows of metrics.jsonl and eval.jsonl, also as scalars (x = the row's step) in TensorBoard
    (out_dir/tensorboard) or wandb (offline mode, out_dir/wandb; `wandb sync` uploads it later)."""

    def __init__(self, kind: str, run_dir: pathlib.Path, config: dict):
        self.kind = kind
        check_tracker(kind)
        try:
            if kind == "tensorboard":
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(pathlib.Path(run_dir) / "tensorboard"))
            else:
                # wandb keeps caches, config and its service's logs under the home directory unless told otherwise
                where = pathlib.Path(run_dir).resolve() / "wandb"
                for var, sub in (("WANDB_DIR", ""), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                                 ("WANDB_DATA_DIR", "data")):
                    os.environ.setdefault(var, str(where / sub))
                import wandb

                self.run = wandb.init(project="hetrl", dir=str(run_dir), mode="offline", config=config,
                                      name=pathlib.Path(run_dir).name, resume="allow")
        except ImportError as e:
            raise InputError(_missing(kind, e.name)) from None

    def log(self, row: dict) -> None:
        step = row.get("step", 0)
        values = {k: float(v) for k, v in row.items() if k != "step" and isinstance(v, (int, float))
                  and not isinstance(v, bool)}
        if self.kind == "tensorboard":
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        else:
            self.run.log(values, step=step)

    def close(self) -> None:
        if self.kind == "tensorboard":
            self.writer.close()
        else:
            self.run.finish()


TRACKER_EXTRAS = {"tensorboard": "tensorboard==2.21.0", "wandb": "wandb==0.31.0"}   # report_to -> its pip pin


def _missing(kind: str, module: str) -> str:
    return (f"report_to={kind} needs the {kind} package ({module} is missing): pip install "
            f"'{TRACKER_EXTRAS[kind]}' (or pip install -e '.[{kind}]'), or report_to=none")


def check_tracker(kind: str) -> None:
    """report_to=`kind`'s package is installed, found without importing it (`hetrl validate` asks this too)."""
    if kind != "none" and importlib.util.find_spec(kind) is None:
        raise InputError(_missing(kind, kind))


def tracker(kind: str, run_dir: pathlib.Path, config: dict) -> Tracker | None:
    return None if kind == "none" else Tracker(kind, run_dir, config)


def plot_curves(rows: list[dict], evals: list[dict], path: pathlib.Path) -> None:
    """Train reward and accuracy per step (`rows`), held-out accuracy where evaluated (`evals`), and in a second
    panel for PPO the critic's value loss and explained variance, for a run with tools its calls per episode, for a
    run rolled out by another engine (vLLM) the mismatch between its log-probs and the trainer's, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in rows if r.get("reward_mean") is not None]     # null: a non-finite mean (guards)
    critic = [r for r in rows if r.get("value_loss") is not None]
    tools = [r for r in rows if r.get("tool_calls_per_episode") is not None]
    mismatch = [r for r in rows if r.get("mismatch/abs_diff_mean") is not None]
    if critic or tools or mismatch:
        fig, (ax, cax) = plt.subplots(2, 1, figsize=(7, 6.5), sharex=True, height_ratios=(3, 2))
    else:
        fig, ax = plt.subplots(figsize=(7, 4))
    if critic:      # PPO: the critic's value loss and explained variance
        cax.plot([r["step"] for r in critic], [r["value_loss"] for r in critic], ".-", color="C3", label="value loss")
        cax.set_ylabel("value loss")
        cax.set_xlabel("step")
        ev = [(r["step"], r["explained_variance"]) for r in critic if r.get("explained_variance") is not None]
        twin = cax.twinx()
        if ev:
            twin.plot(*zip(*ev), "s--", color="C4", label="explained variance")
        twin.axhline(0.0, color="gray", lw=0.8)
        twin.set_ylabel("explained variance")
        cax.grid(alpha=0.3)
        lines = cax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        cax.legend(lines, [h.get_label() for h in lines], loc="upper right")
    elif tools:     # tools (never with PPO): calls per episode, and the share of calls answered with an error
        cax.plot([r["step"] for r in tools], [r["tool_calls_per_episode"] for r in tools], ".-", color="C3",
                 label="tool calls per episode (train, sampled)")
        held = [(r["step"], r["eval_tool_calls_per_episode"]) for r in evals
                if r.get("eval_tool_calls_per_episode") is not None]
        if held:
            cax.plot(*zip(*held), "o-", color="C2", label="tool calls per episode (held-out, greedy)")
        cax.plot([r["step"] for r in tools], [r["tool_error_frac"] for r in tools], "s--", color="C4", alpha=0.7,
                 label="share of train calls answered with an error")
        cax.set_ylabel("per episode / share")
        cax.set_xlabel("step")
        cax.grid(alpha=0.3)
        cax.legend(loc="upper left")
    elif mismatch:  # the rollout engine's log-probs against the trainer's (vLLM; never with tools)
        steps = [r["step"] for r in mismatch]
        for key, style, label in (("mismatch/abs_diff_mean", ".-", "mean |dlogp|"),
                                  ("mismatch/abs_diff_p99", "s--", "p99 |dlogp|"),
                                  ("mismatch/abs_diff_max", "^:", "max |dlogp|"),
                                  ("mismatch/kl_k3", "x-", "KL (k3)")):
            cax.plot(steps, [max(r.get(key) or 0.0, 1e-12) for r in mismatch], style, label=label)
        cax.set_yscale("log")
        cax.set_ylabel("rollout vs trainer")
        cax.set_xlabel("step")
        cax.grid(alpha=0.3)
        cax.legend(loc="upper left", fontsize=8)
        out = [(r["step"], r["mismatch/ratio_out_of_range_frac"]) for r in mismatch
               if r.get("mismatch/ratio_out_of_range_frac")]
        if out:
            twin = cax.twinx()
            twin.plot(*zip(*out), "o", color="C5", label="ratio outside [0.5, 2]")
            twin.set_ylabel("token share")
            twin.legend(loc="upper right", fontsize=8)
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r["reward_mean"] for r in train], "--", lw=2.5, alpha=0.6, label="train reward (mean)")
        if all("accuracy" in r for r in train):
            ax.plot(steps, [r["accuracy"] for r in train], ".-", label="train accuracy (sampled)")
    key = "eval_accuracy" if evals and all("eval_accuracy" in r for r in evals) else "eval_reward"
    evals = [r for r in evals if r.get(key) is not None]
    if evals:
        ax.plot([r["step"] for r in evals], [r[key] for r in evals], "o-",
                label=f"held-out {key.removeprefix('eval_')} (greedy)")
    ax.set_xlabel("step")
    values = [r["reward_mean"] for r in train] + [r[key] for r in evals]
    ax.set_ylim(min([-0.02] + values), max([1.0] + values))
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    else:   # every step's and evaluation's reward was null (no row scored): an empty plot would read as a bug
        ax.text(0.5, 0.5, "no scored rewards to plot (metrics.jsonl: reward_errors)", ha="center",
                transform=ax.transAxes)
    fig.tight_layout()
    tmp = files.temp_path(path, ".png")
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if tmp.exists():
            tmp.unlink()
