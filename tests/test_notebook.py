"""The visualization notebook runs end to end on the results of a real tiny sweep, and draws its figures."""

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient


EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import sweep  # noqa: E402


@pytest.fixture(scope="module")
def sweep_csv(tmp_path_factory, model_cache):
    out = tmp_path_factory.mktemp("sweep")
    csv_path = out / "sweep.csv"
    # k = 2, 4 so every plot has more than one point (one prompt length: the plots take the longest, or one line per
    # length); a tiny model so that each of the 4 runs takes seconds
    tiny = ["--hidden_size", "32", "--intermediate_size", "64", "--max_position_embeddings", "256",
            "--model_cache_dir", str(model_cache)]  # fmt: skip
    argv = ["--ks", "2", "4", "--prompt_lengths", "64", "--completion_length", "8", "--max_steps", "2",
            "--csv", str(csv_path), "--", *tiny]  # fmt: skip
    assert sweep.main(argv) == 0
    return csv_path, argv


def test_sweep_writes_tidy_rows_and_skips_finished_runs(sweep_csv, capsys):
    import pandas as pd

    csv_path, argv = sweep_csv
    df = pd.read_csv(csv_path)
    assert list(df.columns) == sweep.COLUMNS
    assert df["run_id"].nunique() == 4 and set(df["method"]) == {"stock", "ours"}
    assert {"peak_rss_gib", "time_s", "step_time_s", "working_gib"} <= set(df["metric"])
    # The headline peak of the run and of each of its phases
    assert {"run", "generation", "train", "optimizer"} <= set(df[df["metric"] == "peak_gib"]["phase"])
    assert sweep.main(argv) == 0  # everything finished: nothing runs again
    assert capsys.readouterr().out.count("skipped") == 4


def test_notebook_runs_and_draws(sweep_csv):
    csv_path, _ = sweep_csv
    notebook = nbformat.read(EXPERIMENTS / "memory_report.ipynb", as_version=4)
    os.environ["RLOO_RESULTS_CSV"] = str(csv_path)
    try:
        NotebookClient(notebook, timeout=300, kernel_name="python3",
                       resources={"metadata": {"path": str(EXPERIMENTS)}}).execute()  # fmt: skip
    finally:
        del os.environ["RLOO_RESULTS_CSV"]
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs if o.output_type == "error"]
    assert not errors
    images = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs
              if "image/png" in o.get("data", {})]  # fmt: skip
    assert len(images) == 3
    for name in ("phase_peaks.png", "savings.png", "timeline.png"):
        assert (csv_path.parent / name).stat().st_size > 10_000
