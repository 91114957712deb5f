"""
Plots from the sweep CSV (experiments/sweep.py), and nothing else: per-phase peak memory stock vs ours as k grows,
the saving in percent, step time, and one run's memory over time with its phase boundaries. PNGs go next to the CSV.

    python experiments/plot_results.py --csv results/sweep.csv
"""

import argparse
import sys
from pathlib import Path

import matplotlib


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


PHASES = ["generation", "policy_logps", "reference_logps", "reward", "train", "optimizer"]
COLORS = {"stock": "#9e9e9e", "ours": "#1f77b4"}


def load(csv_path) -> pd.DataFrame:
    df = pd.read_csv(csv_path)
    if df.empty:
        raise ValueError(f"{csv_path} holds no rows: run experiments/sweep.py first")
    return df


def phase_peaks(df: pd.DataFrame) -> pd.DataFrame:
    """Whole-run `peak_gib` per (method, P, k, phase), above the memory after load of its run."""
    rows = df[(df["metric"] == "peak_gib") & df["phase"].isin(PHASES)].copy()
    if rows.empty:
        raise ValueError("the CSV has no per-phase peak_gib rows (it predates them): write it again with "
                         "experiments/compare.py or experiments/sweep.py --rerun")  # fmt: skip
    after_load = df[df["metric"] == "memory_after_load_gib"].groupby("run_id")["value"].first()
    rows["value"] = rows["value"] - rows["run_id"].map(after_load)
    return rows.groupby(["method", "prompt_length", "k", "phase"])["value"].max().reset_index()


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (P, k): whole-run working memory and median step time, stock vs ours, and their ratios."""
    working = df[df["metric"] == "working_gib"].pivot_table(index=["prompt_length", "k"], columns="method", values="value")
    steps = df[(df["metric"] == "step_time_s") & (df["step"] > 1)]  # step 1 pays one-time costs
    times = steps.pivot_table(index=["prompt_length", "k"], columns="method", values="value", aggfunc="median")
    out = pd.DataFrame(index=working.index)
    for method in ("stock", "ours"):
        if method in working:
            out[f"working_gib_{method}"] = working[method]
            out[f"step_time_s_{method}"] = times.get(method)
    if {"working_gib_stock", "working_gib_ours"} <= set(out.columns):
        out["memory_ratio"] = out["working_gib_ours"] / out["working_gib_stock"]
        out["saving_pct"] = 100 * (1 - out["memory_ratio"])
        out["time_ratio"] = out["step_time_s_ours"] / out["step_time_s_stock"]
    return out.reset_index()


def plot_phase_peaks(df: pd.DataFrame, path: Path) -> Path:
    peaks = phase_peaks(df)
    prompt_length = peaks["prompt_length"].max()
    peaks = peaks[peaks["prompt_length"] == prompt_length]
    ks = sorted(peaks["k"].unique())
    fig, axes = plt.subplots(1, len(ks), figsize=(4.5 * len(ks), 3.8), sharey=True, squeeze=False)
    for ax, k in zip(axes[0], ks, strict=True):
        sub = peaks[peaks["k"] == k]
        phases = [p for p in PHASES if p in set(sub["phase"])]
        for offset, method in ((-0.2, "stock"), (0.2, "ours")):
            values = [sub[(sub["method"] == method) & (sub["phase"] == p)]["value"].max() for p in phases]
            ax.bar([i + offset for i in range(len(phases))], values, width=0.4, label=method, color=COLORS[method])
        ax.set_xticks(range(len(phases)), [p.replace("_", "\n") for p in phases], fontsize=8)
        ax.set_title(f"k = {k}, P = {prompt_length}")
    axes[0][0].set_ylabel("peak above after-load (GiB)")
    axes[0][0].legend()
    fig.suptitle("Peak memory per phase: stock TRL vs rloo_efficient")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_savings(df: pd.DataFrame, path: Path) -> Path:
    table = summary(df)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for prompt_length, sub in table.groupby("prompt_length"):
        if "saving_pct" in sub:
            left.plot(sub["k"], sub["saving_pct"], marker="o", label=f"P = {prompt_length}")
        for method, style in (("stock", "--"), ("ours", "-")):
            if f"step_time_s_{method}" in sub:
                right.plot(sub["k"], sub[f"step_time_s_{method}"], style, marker="o", label=f"{method}, P = {prompt_length}")
    left.set(xlabel="k (completions per prompt)", ylabel="whole-run working memory saved (%)", title="Memory saving")
    right.set(xlabel="k (completions per prompt)", ylabel="median step time (s)", title="Step time")
    for ax in (left, right):
        ax.set_xticks(sorted(table["k"].unique()))
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(df: pd.DataFrame, path: Path, prompt_length=None, k=None) -> Path:
    """Memory over the first step of one run, per method: each phase segment's peak, and memory at its end."""
    timeline = df[df["metric"].str.startswith("timeline/")]
    prompt_length = prompt_length or timeline["prompt_length"].max()
    k = k or timeline[timeline["prompt_length"] == prompt_length]["k"].max()
    methods = [m for m in ("stock", "ours") if m in set(timeline["method"])]
    fig, axes = plt.subplots(len(methods), 1, figsize=(10, 3.2 * len(methods)), sharey=True, squeeze=False)
    for ax, method in zip(axes[:, 0], methods, strict=True):
        sub = timeline[(timeline["method"] == method) & (timeline["prompt_length"] == prompt_length) & (timeline["k"] == k)]
        seg = sub.pivot_table(index=["step", "phase"], columns="metric", values="value").reset_index().sort_values("step")
        seg = seg.rename(columns=lambda c: c.replace("timeline/", ""))
        first_step_end = seg[seg["phase"] == "optimizer"]["end_s"].min()
        seg = seg[seg["end_s"] <= first_step_end] if pd.notna(first_step_end) else seg
        if "peak_allocated_gib" in seg:
            ax.stairs(seg["peak_reserved_gib"], [*seg["start_s"], seg["end_s"].iloc[-1]], label="peak reserved", color="#d62728")
            ax.stairs(seg["peak_allocated_gib"], [*seg["start_s"], seg["end_s"].iloc[-1]], label="peak allocated", color="#1f77b4")
            ax.fill_between(seg["end_s"], seg["allocated_gib"], seg["reserved_gib"], step="post", alpha=0.25,
                            color="#d62728", label="fragmentation (reserved - allocated)")  # fmt: skip
        else:
            ax.stairs(seg["peak_rss_gib"], [*seg["start_s"], seg["end_s"].iloc[-1]], label="peak RSS in phase", color="#1f77b4")
            ax.plot(seg["end_s"], seg["rss_gib"], ".", color="#555555", label="RSS at phase end")
        for _, row in seg.iterrows():
            ax.axvline(row["start_s"], color="#bbbbbb", lw=0.6, ls=":")
            ax.text(row["start_s"], 1.0, row["phase"].replace("_", " "), transform=ax.get_xaxis_transform(),
                    rotation=90, va="top", fontsize=7)  # fmt: skip
        ax.set_title(f"{method}: memory over the first step (P = {prompt_length}, k = {k})", fontsize=10)
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("seconds since the trainer was built")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def make_all(csv_path) -> list[Path]:
    csv_path = Path(csv_path)
    df = load(csv_path)
    out = csv_path.parent
    return [
        plot_phase_peaks(df, out / "phase_peaks.png"),
        plot_savings(df, out / "savings.png"),
        plot_timeline(df, out / "timeline.png"),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", default="results/sweep.csv")
    args = parser.parse_args(argv)
    if not Path(args.csv).exists():
        parser.error(f"{args.csv} does not exist: run experiments/sweep.py (or ./run_improved.sh) first")
    for path in make_all(args.csv):
        print(f"[plot] {path}")
    print(summary(load(args.csv)).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
