"""metrics.jsonl read back (a line cut by a crash included), the report page, and export's losses from the same
reader: exact values on hand-written rows."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gpt4all_training.export.hf import final_losses
from gpt4all_training.tracking.report import write_report
from gpt4all_training.tracking.tracker import read_metrics

ROWS = [{"step": 1, "loss": 2.0, "lr": 1e-3}, {"step": 2, "loss": 1.0, "lr": 5e-4},
        {"step": 2, "val_loss": 1.5, "val_ppl": math.exp(1.5)}]


def write_metrics(folder: Path, rows: list[dict], tail: str = "") -> Path:
    path = folder / "metrics.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail, encoding="utf-8")
    return path


def test_read_metrics_stops_at_a_cut_last_line(tmp_path):
    cut = json.dumps({"step": 3, "loss": 0.5})[:11]  # '{"step": 3,': the write a crash interrupted
    assert read_metrics(write_metrics(tmp_path, ROWS, tail=cut)) == ROWS


def test_read_metrics_skips_blank_lines_and_a_missing_file_has_no_rows(tmp_path):
    assert read_metrics(write_metrics(tmp_path, ROWS, tail="\n\n")) == ROWS
    assert read_metrics(tmp_path / "nowhere.jsonl") == []


def test_final_losses_survive_a_cut_last_line(tmp_path):
    """The last value of every *loss* key, and the last step, from the rows before the cut one."""
    path = write_metrics(tmp_path, [*ROWS, {"step": 3, "loss": 0.75}], tail='{"step": 4, "lo')
    assert final_losses(path) == ({"loss": 0.75, "val_loss": 1.5}, 3)


def test_report_draws_both_curves_and_tabulates_the_summary(tmp_path):
    """Steps 1..2 and losses 1.0..2.0 fill the 720 x 320 plot: x = 50 + (step - 1) * 660,
    y = 295 - (loss - 1.0) * 280. A NaN loss (a skipped step) is not drawn; keys and values are escaped."""
    write_metrics(tmp_path, [*ROWS, {"step": 2, "loss": math.nan}], tail='{"step"')
    path = write_report(tmp_path, {"final_loss": 1.0, "a<b": "x&y"})
    assert path == tmp_path / "report.html"
    page = path.read_text(encoding="utf-8")
    assert page.startswith("<!doctype html><html><head><meta charset='utf-8'><title>training report</title>")
    assert page.count("<polyline") == 2
    assert '<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="50.0,15.0 710.0,295.0"/>' in page
    assert '<polyline fill="none" stroke="#ff7f0e" stroke-width="2" points="710.0,155.0"/>' in page
    assert '<text x="50" y="15" font-size="12">loss 2.000</text>' in page
    assert '<text x="50" y="315" font-size="12">loss 1.000 | step 1 .. 2</text>' in page
    assert ("<table><tr><th>final_loss</th><td>1.0</td></tr>"
            "<tr><th>a&lt;b</th><td>&quot;x&amp;y&quot;</td></tr></table>") in page


def test_report_without_losses_says_so(tmp_path):
    page = write_report(tmp_path, {}).read_text(encoding="utf-8")
    assert "<p>No loss was logged.</p>" in page and "<svg" not in page
