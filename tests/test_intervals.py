"""intervals.py against values worked out by hand, and the per-example scores that results.json keeps."""

from __future__ import annotations

import math

import pytest

from gpt4all_training.intervals import Comparison, Interval, mean, paired, proportion, verdict
from gpt4all_training.evaluation.results import comparison_rows, comparison_table, interval_table, per_example

Z = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson(k: int, n: int) -> tuple[float, float]:
    """The Wilson score interval written out: (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n)."""
    p = k / n
    centre, half = p + Z * Z / (2 * n), Z * math.sqrt(p * (1 - p) / n + Z * Z / (4 * n * n))
    return (centre - half) / (1 + Z * Z / n), (centre + half) / (1 + Z * Z / n)


def test_wilson_intervals_of_proportions_are_the_hand_values():
    # 0 of 40: [0, z^2 / (n + z^2)] = [0, 3.8415 / 43.8415]
    assert proportion(0, 40) == Interval(0.0, 0.0, pytest.approx(0.0876216, abs=1e-7), 40)
    # 20 of 40: 0.5 -+ (z / (1 + z^2/40)) sqrt(0.25/40 + z^2/6400) = 0.5 -+ 0.1480047
    half = proportion(20, 40)
    assert (half.low, half.high) == (pytest.approx(0.3519953, abs=1e-7), pytest.approx(0.6480047, abs=1e-7))
    for k, n in ((1, 300), (83, 300), (299, 300), (7, 9)):
        low, high = wilson(k, n)
        assert (proportion(k, n).low, proportion(k, n).high) == (pytest.approx(low, abs=1e-12),
                                                                  pytest.approx(high, abs=1e-12))


def test_a_mean_of_zeros_and_ones_is_a_proportion_and_other_values_are_bootstrapped():
    assert mean([1, 0, 0, 1, 1]) == proportion(3, 5)
    values = [0.2, 0.4, 0.9, 0.1, 0.5, 0.7, 0.3, 0.6]
    interval = mean(values)
    assert interval.value == pytest.approx(0.4625) and interval.n == 8
    # The percentile bootstrap of a mean is close to the normal interval, mean -+ z s / sqrt(n) (s: population sd).
    sd = math.sqrt(sum((v - 0.4625) ** 2 for v in values) / 8)
    assert interval.low == pytest.approx(0.4625 - Z * sd / math.sqrt(8), abs=0.02)
    assert interval.high == pytest.approx(0.4625 + Z * sd / math.sqrt(8), abs=0.02)
    assert mean(values) == interval  # seeded: the same values give the same interval
    assert mean([0.3]).value == 0.3 and math.isnan(mean([0.3]).low)  # one value leaves nothing to resample


def test_a_paired_difference_counts_only_the_items_that_changed():
    # 300 items: 30 turn right, 5 turn wrong, the rest alike. Difference +25/300; its sd per item is
    # sqrt(35/300 - (25/300)^2), so the normal interval is 0.0833 -+ 1.96 * 0.3303 / sqrt(300) = [0.0460, 0.1207].
    before = [0] * 30 + [1] * 5 + [1] * 100 + [0] * 165
    after = [1] * 30 + [0] * 5 + [1] * 100 + [0] * 165
    result = paired(before, after)
    assert result.difference == pytest.approx(25 / 300) and result.n == 300 and result.verdict == "better"
    assert result.low == pytest.approx(0.0460, abs=0.006) and result.high == pytest.approx(0.1207, abs=0.006)
    assert paired(after, before).verdict == "worse"
    assert paired(after, before, higher_is_better=False).verdict == "better"  # perplexity-like: lower is better
    # The same scores on the same items: no change, an interval of zero width.
    assert paired(before, before) == Comparison(0.0, 0.0, 0.0, 300, "no measurable difference")
    # 3 items gained and 2 lost of 40: within the noise.
    assert paired([1, 1, 0, 0, 0] + [0] * 35, [0, 0, 1, 1, 1] + [0] * 35).verdict == "no measurable difference"
    with pytest.raises(ValueError, match="same items"):
        paired([1, 0], [1])


def test_the_verdict_reads_the_interval():
    assert verdict(0.01, 0.2) == "better" and verdict(-0.2, -0.01) == "worse"
    assert verdict(-0.01, 0.2) == "no measurable difference" and verdict(0.0, 0.2) == "no measurable difference"
    assert verdict(0.01, 0.2, higher_is_better=False) == "worse"


def test_intervals_and_comparisons_print_as_people_read_them():
    assert proportion(20, 40).percent() == "50.0% [35.2, 64.8]"
    assert proportion(20, 40).number() == "0.5000 [0.3520, 0.6480]"
    assert Comparison(0.0833, 0.046, 0.1207, 300, "better").points() == "+8.3 points [+4.6, +12.1]: better"
    assert Interval(0.3, math.nan, math.nan, 1).percent() == "30.0% [-]"


def harness_samples(values: dict[str, list[float]], task: str = "t") -> dict[str, list[dict]]:
    """The shape of lm-evaluation-harness's logged samples: one per document and filter, its metrics by name."""
    return {task: [{"doc_id": i, "doc_hash": f"h{i}", "filter": "none", "metrics": list(values), **{
        metric: column[i] for metric, column in values.items()}} for i in range(len(next(iter(values.values()))))]}


def test_per_example_keeps_the_scores_that_are_means_of_their_examples():
    samples = harness_samples({"acc": [True, False, True, True], "perplexity": [-1.0, -2.0, -0.5, -1.5]})
    results = {"t": {"acc,none": 0.75, "perplexity,none": math.exp(1.25)}}
    assert per_example(samples, results) == {"t": {"acc,none": {"0:h0": 1.0, "1:h1": 0.0, "2:h2": 1.0, "3:h3": 1.0}}}


def results_of(values: list[int], stderr: float) -> dict:
    acc = sum(values) / len(values)
    return {"results": {"t": {"alias": "t", "acc,none": acc, "acc_stderr,none": stderr, "perplexity,none": 3.0}},
            "higher_is_better": {"t": {"acc": True, "perplexity": False}},
            "per_example": per_example(harness_samples({"acc": values}), {"t": {"acc,none": acc}})}


def test_the_tables_give_each_score_its_interval_and_each_change_its_paired_interval():
    before = results_of([0] * 60 + [1] * 40, 0.049)
    after = results_of([1] * 30 + [0] * 30 + [1] * 40, 0.047)
    table = interval_table(after).splitlines()
    low, high = wilson(70, 100)
    assert table[0].split() == ["task", "metric", "score", "[95%", "interval]", "n", "stderr"]
    assert table[2].split() == ["t", "acc", "none", "0.7000", f"[{low:.4f},", f"{high:.4f}]", "100", "0.0470"]
    assert table[3].split() == ["t", "perplexity", "none", "3.0000", "-", "-"]
    [acc, perplexity] = comparison_rows(before, after)
    assert acc["paired"].difference == pytest.approx(0.3) and acc["paired"].verdict == "better"
    assert perplexity["paired"] is None and perplexity["change"] == 0.0
    lines = comparison_table(before, after).splitlines()
    assert lines[2].startswith("t     acc none         0.4000 [") and lines[2].endswith(": better")
    assert lines[3].split() == ["t", "perplexity", "none", "3.0000", "3.0000", "+0.0000"]
    # An older results.json without the examples' values: the bare difference, no verdict.
    old = {key: value for key, value in before.items() if key != "per_example"}
    assert comparison_table(old, after).splitlines()[2].split()[:5] == ["t", "acc", "none", "0.4000", "0.7000"]
    assert comparison_table(old, after).splitlines()[2].split()[-1] == "+0.3000"


def test_the_training_report_gives_the_held_out_scores_their_intervals(tmp_path):
    import json
    import re

    from gpt4all_training.evaluation.results import report_rows
    from gpt4all_training.tracking.report import write_report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")
    page = write_report(tmp_path, {"steps": 1, "val_rewards/accuracies": 0.75, "val_pairs": 8},
                        report_rows(results_of([1] * 30 + [0] * 10, 0.07))).read_text()
    scores = re.search(r"<table id='scores'>(.*?)</table>", page).group(1)
    cells = [re.findall(r"<t[hd]>(.*?)</t[hd]>", row) for row in scores.split("</tr>") if row]
    low, high = wilson(6, 8)
    acc_low, acc_high = wilson(30, 40)
    assert cells == [["score", "value [95% interval]", "over"],
                     ["val_rewards/accuracies", f"0.7500 [{low:.4f}, {high:.4f}]", "8 validation pairs"],
                     ["harness/t/acc", f"0.7500 [{acc_low:.4f}, {acc_high:.4f}]", "40 examples"],
                     ["harness/t/perplexity", "3.0000", "no interval: not a mean over examples"]]


def test_the_studios_before_after_rows_carry_the_intervals_and_the_paired_verdict():
    from gpt4all_training.studio.actions import score_rows

    before = results_of([0] * 60 + [1] * 40, 0.049)
    after = results_of([1] * 30 + [0] * 30 + [1] * 40, 0.047)
    [acc, perplexity] = score_rows([before, after])
    paired_acc = comparison_rows(before, after)[0]["paired"]
    assert acc == {"task": "t", "metric": "acc", "values": [0.4, 0.7],
                   "intervals": [pytest.approx(list(wilson(40, 100))), pytest.approx(list(wilson(70, 100)))],
                   "change": pytest.approx(0.3), "change_interval": [paired_acc.low, paired_acc.high],
                   "verdict": "better"}
    assert perplexity == {"task": "t", "metric": "perplexity", "values": [3.0, 3.0], "intervals": [None, None],
                          "change": 0.0, "change_interval": None, "verdict": None}
    [one] = score_rows([{**after, "per_example": {"t": {"acc,none": {"0:h0": 1.0}}}}])[:1]
    assert one["intervals"] == [pytest.approx(list(wilson(1, 1)))] and one["verdict"] is None
