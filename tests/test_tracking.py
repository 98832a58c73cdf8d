"""metrics.jsonl read back (a line cut by a crash included), the report page (checked in headless Chromium for a
run with one evaluation and one with many), and export's losses from the same reader."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from support.browser import Browser, chromium_path
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


def training_rows(steps: int, eval_every: int) -> list[dict]:
    """metrics.jsonl as the loop writes it: a training row per step, a validation row every `eval_every` steps."""
    rows = []
    for step in range(1, steps + 1):
        rows.append({"step": step, "loss": 3.0 * math.exp(-step / 40) + 0.5, "lr": 1e-3 * (1 - step / (steps + 1)),
                     "grad_norm": 4.0 * math.exp(-step / 20) + 0.1, "tokens_per_s": 12345.678 + step,
                     "trained_tokens_per_s": 6000.5, "padding_fraction": 0.3, "peak_rss_mb": 1500.0 + step})
        if step % eval_every == 0:
            rows.append({"step": step, "val_loss": 3.0 * math.exp(-step / 40) + 0.7, "val_ppl": 9.0})
    return rows


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if not executable:
        pytest.skip("chromium is not installed and scripts/ensure_chromium.sh could not install it")
    with Browser(executable, height=1400) as b:
        yield b


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("steps, eval_every", [(1, 1), (120, 20)], ids=["one-evaluation", "many-evaluations"])
def test_report_draws_every_panel_with_axes_and_legends(browser, tmp_path, steps, eval_every):
    write_metrics(tmp_path, training_rows(steps, eval_every))
    path = write_report(tmp_path, {"final_loss": 0.51234567, "trained_tokens_per_s": 6123.4567, "steps": steps,
                                   "a<b": "x&y"})
    assert path == tmp_path / "report.html"
    browser.open(path)
    browser.screenshot(tmp_path / "report.png")
    panels = browser.evaluate("[...document.querySelectorAll('figure.panel')].map(f => f.id)")
    assert panels == ["panel-loss", "panel-lr", "panel-grad-norm", "panel-throughput", "panel-padding",
                      "panel-memory"]
    # Every evaluation is a marker, so a run with one evaluation still shows its validation loss.
    assert browser.evaluate("document.querySelectorAll('#validation-loss use').length") == steps // eval_every
    assert browser.evaluate("document.querySelector('#train-loss path').getAttribute('d').length") > 0
    # Smoothing from 10 steps on; below that every step is a marker of its own.
    smoothed = browser.evaluate("document.getElementById('train-loss-smoothed') !== null")
    assert smoothed == (steps >= 10)
    assert browser.evaluate("document.querySelectorAll('#train-loss use').length") == (0 if smoothed else steps)
    legend = browser.evaluate("document.getElementById('panel-loss').textContent")
    assert "train loss" in legend and "validation loss" in legend and "optimizer step" in legend
    for panel in panels:  # tick labels on both axes
        ticks = browser.evaluate(f"[...document.querySelectorAll('#{panel} [id^=xtick_] text, "
                                 f"#{panel} [id^=ytick_] text')].map(t => t.textContent)")
        assert len(ticks) >= 4, (panel, ticks)
    cells = browser.evaluate("[...document.querySelectorAll('tr')].map(r => r.textContent)")
    assert cells == ["final_loss0.5123", "trained_tokens_per_s6,123", f"steps{steps}", "a<bx&y"]
    assert browser.errors == []


def test_report_leaves_a_skipped_step_out_and_escapes_the_summary(tmp_path):
    write_metrics(tmp_path, [*ROWS, {"step": 3, "loss": math.nan}], tail='{"step"')
    page = write_report(tmp_path, {"skipped_steps": 1, "a<b": "x&y"}).read_text(encoding="utf-8")
    assert "<tr><th>skipped_steps</th><td>1</td></tr><tr><th>a&lt;b</th><td>x&amp;y</td></tr>" in page
    assert "nan" not in page.lower()


def test_report_without_losses_says_so(tmp_path):
    page = write_report(tmp_path, {}).read_text(encoding="utf-8")
    assert "<p>No loss was logged.</p>" in page and "<svg" not in page
