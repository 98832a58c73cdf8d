"""build_map.py: the layout (UMAP) and clusters (k-means, class-based TF-IDF labels) on planted structure, the colour
scales, and the page itself in a real headless Chromium (Debian's package, driven over the DevTools protocol by
support.browser) from inference runs of the tiny model: every point drawn with no console error, the cluster table,
search, hover, --compare, the lasso and cluster selections downloaded and read back by curate, and 100k points."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image  # installed with tensorboard (requirements.txt); an independent PNG decoder

from support.browser import Browser, chromium_path
from support.inference_runs import write_inference_run
from support.models import build_tiny_gptj
from gpt4all_training.analysis.curation.curate import REMOVED_FILE, CurateOptions, curate
from gpt4all_training.analysis.inference import run_inference
from gpt4all_training.analysis.map.build import build_map
from gpt4all_training.analysis.map.clusters import cluster_labels, cluster_points
from gpt4all_training.analysis.map.layout import embedding_features, layout_points
from gpt4all_training.analysis.map.render import BACKGROUND, BINS, change_scale, truncate
from gpt4all_training.analysis.map.runs import load_run, loss_change
from gpt4all_training.config.schemas import InferenceConfig
from gpt4all_training.errors import UserError


# ---------------------------------------------------------------- helpers

def page_data(html_path: Path) -> dict:
    html = html_path.read_text(encoding="utf-8")
    raw = re.search(r'<script type="application/json" id="map-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(raw)


def text(browser: Browser, element_id: str) -> str:
    return browser.evaluate(f"document.getElementById({json.dumps(element_id)}).textContent")


def cluster_rows(browser: Browser) -> list[list[str]]:
    return browser.evaluate("[...document.querySelectorAll('tr.cluster-row')]"
                            ".map(tr => [...tr.cells].map(td => td.textContent))")


def planted(n_per: int = 100, n_clusters: int = 10, dim: int = 100, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_clusters, dim)) * 2.0
    labels = np.repeat(np.arange(n_clusters), n_per)
    return (centres[labels] + rng.standard_normal((len(labels), dim))).astype(np.float32), labels


@pytest.fixture(scope="module")
def browser():
    executable = chromium_path()
    if not executable:
        pytest.skip("chromium is not installed and scripts/ensure_chromium.sh could not install it")
    with Browser(executable) as b:
        yield b


# ---------------------------------------------------------------- real inference runs of the tiny model

@pytest.fixture(scope="module")
def runs(tiny_model_dir, tokenizer, clean_dolly, tmp_path_factory) -> tuple[Path, Path]:
    """(after, before): the fixture model, and a differently initialised one standing in for the base."""
    root = tmp_path_factory.mktemp("map-runs")
    other_model = root / "other-model"
    build_tiny_gptj(tokenizer, seed=1).save_pretrained(other_model)
    tokenizer.save_pretrained(other_model)
    out = []
    for name, model in (("after", tiny_model_dir), ("before", other_model)):
        config = InferenceConfig(model_name=str(model), dataset_path=str(clean_dolly), output_dir=str(root / name),
                                 max_length=128, val_fraction=0.1, batch_size=16, num_proc=1)
        out.append(run_inference(config).parent)
    return out[0], out[1]


@pytest.fixture(scope="module")
def single_map(runs, tmp_path_factory):
    output = tmp_path_factory.mktemp("map-single") / "map.html"
    return build_map(runs[0], output, n_clusters=8)


@pytest.mark.integration
@pytest.mark.slow
def test_map_renders_every_point_and_the_cluster_table(browser, single_map):
    browser.open(single_map.html)
    assert browser.evaluate("document.body.dataset.ready") == "1"
    assert text(browser, "point-count") == text(browser, "rendered-count") == "619"
    rows = cluster_rows(browser)
    assert len(rows) == 8
    # Sorted by mean loss, hardest first, and the same as clusters.csv.
    means = [float(row[3]) for row in rows]
    assert means == sorted(means, reverse=True)
    with open(single_map.clusters_csv, encoding="utf-8") as f:
        header, *lines = [line.rstrip("\n") for line in f]
    assert header == "cluster,label,size,mean_loss,median_loss,mean_n_tokens,top_source,train,val"
    assert [row[0] for row in rows] == [line.split(",")[0] for line in lines]
    assert sum(int(row[2]) for row in rows) == 619
    # then every numeric column: n_tokens, and the outlier score inference writes by default
    assert browser.evaluate("[...document.getElementById('color-by').options].map(o => o.value)") == \
        ["loss", "cluster", "source", "split", "n_tokens", "outlier"]
    # Points are drawn bigger than the old 2-3 px squares when there are few of them.
    assert browser.evaluate("pointSize(frame())") >= 6
    assert browser.errors == []


@pytest.mark.integration
@pytest.mark.slow
def test_page_loads_nothing_from_the_network(single_map):
    html = single_map.html.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html and "url(" not in html


@pytest.mark.integration
@pytest.mark.slow
def test_screenshot_is_not_blank(browser, single_map, tmp_path):
    browser.open(single_map.html)
    browser.next_frame()
    pixels = np.asarray(Image.open(browser.screenshot(tmp_path / "map-screenshot.png")).convert("RGB"))
    assert pixels.shape == (800, 1280, 3)
    plot = pixels[:, :880]  # the canvas; the side panel is 380 px wide
    background = np.array(Image.new("RGB", (1, 1), BACKGROUND).getpixel((0, 0)), dtype=np.uint8)
    drawn = np.any(plot != background, axis=-1)
    assert 0.002 < drawn.mean() < 0.5
    assert len(np.unique(plot.reshape(-1, 3), axis=0)) >= 20  # a loss ramp, not one flat colour


@pytest.mark.integration
@pytest.mark.slow
def test_search_selects_exactly_the_matching_points(browser, single_map, runs):
    run = load_run(runs[0])
    texts = [(p + "\n" + r).lower() for p, r in zip(truncate(run.prompt, 240), truncate(run.response, 240))]
    expected = sum("water" in t for t in texts)
    assert 0 < expected < 619
    browser.open(single_map.html, fragment="#search=water&color=source")
    assert text(browser, "match-count") == str(expected)
    assert text(browser, "rendered-count") == "619"  # dimmed points are still drawn
    assert len(json.loads(browser.evaluate("document.getElementById('selection-json').value"))["ids"]) == expected
    assert browser.errors == []


@pytest.mark.integration
@pytest.mark.slow
def test_hover_card_shows_the_example(browser, single_map):
    data = page_data(single_map.html)
    xy = np.stack([data["x"], data["y"]], axis=1)
    gaps = np.sqrt(((xy[:, None] - xy[None]) ** 2).sum(-1) + np.eye(len(xy)) * 9).min(axis=1)
    loneliest = int(gaps.argmax())  # the hover card must show this point, not a neighbour on top of it
    assert gaps[loneliest] > 0.005
    split, index = data["splits"][data["split"][loneliest]], data["index"][loneliest]
    browser.open(single_map.html, fragment=f"#point={split}:{index}")
    card = text(browser, "tip")
    assert card.startswith(f"{split} #{index}  source {data['sources'][data['source'][loneliest]]}\nloss ")
    assert f"\nprompt: {data['prompt'][loneliest]}\nresponse: {data['response'][loneliest]}" in card


@pytest.mark.integration
@pytest.mark.slow
def test_static_png_has_the_points_and_a_colour_bar(single_map):
    image = np.asarray(Image.open(single_map.png).convert("RGB"))
    assert image.shape == (800, 1000, 3)
    background = np.array(Image.new("RGB", (1, 1), BACKGROUND).getpixel((0, 0)), dtype=np.uint8)
    assert np.any(image != background, axis=-1).sum() >= 619
    # The colour bar: a column right of the points that runs through the whole ramp.
    assert max(len(np.unique(image[:, x], axis=0)) for x in range(800, 1000)) >= 40


@pytest.mark.integration
@pytest.mark.slow
def test_same_input_and_seed_give_the_same_map(runs, single_map, tmp_path):
    again = build_map(runs[0], tmp_path / "again.html", n_clusters=8)
    first, second = page_data(single_map.html), page_data(again.html)
    assert first["x"] == second["x"] and first["y"] == second["y"] and first["cluster"] == second["cluster"]
    assert single_map.clusters_csv.read_text() == again.clusters_csv.read_text()


@pytest.mark.integration
@pytest.mark.slow
def test_compare_colors_by_loss_change(browser, runs, tmp_path):
    after, before = runs
    result = build_map(after, tmp_path / "compare.html", compare=before, n_clusters=6)
    data = page_data(result.html)
    a, b = pq.read_table(after / "inference.parquet"), pq.read_table(before / "inference.parquet")
    assert a.column("index").to_pylist() == b.column("index").to_pylist()
    change = a.column("loss").to_numpy() - b.column("loss").to_numpy()
    assert np.abs(change).max() > 1e-3  # two different models
    np.testing.assert_allclose(data["change"], change, atol=1e-4)
    labels = np.asarray(data["cluster"])
    for row in result.clusters:
        assert row["mean_loss_change"] == pytest.approx(change[labels == row["cluster"]].mean(), abs=1e-4)
    browser.open(result.html)
    assert text(browser, "rendered-count") == "619"
    assert browser.evaluate("document.getElementById('color-by').value") == "loss change"
    assert browser.evaluate("[...document.querySelectorAll('#cluster-head th')].at(-1).textContent") \
        .startswith("mean change")
    assert browser.errors == []


def test_changes_of_one_sign_use_their_own_range():
    """Every loss went down: the blue half of the ramp spans the data, not one pale shade near zero."""
    rng = np.random.default_rng(0)
    down = -rng.uniform(0.5, 2.0, 1000)
    scale = change_scale(down)
    codes = scale.codes()
    assert codes.min() == 0 and codes.max() == BINS - 1
    assert len(np.unique(codes)) > BINS // 2
    colors = np.array([[int(c[i:i + 2], 16) for i in (1, 3, 5)] for c in scale.colors()[:BINS]])
    assert (colors[:, 2] > colors[:, 0]).all()  # blue everywhere: nothing went up
    # Both signs: zero is the neutral middle of the diverging ramp, and the biggest changes are drawn last.
    mixed = np.concatenate([down, rng.uniform(0.1, 0.3, 200)])
    scale = change_scale(mixed)
    assert abs(float(scale.norm(0.0)) - 0.5) < 1e-9
    order = scale.draw_order()
    assert order[0] == BINS and order[-1] == 0  # missing first, the largest drop (most negative) on top


@pytest.mark.integration
@pytest.mark.slow
def test_lasso_and_cluster_selections_round_trip_into_curate(browser, single_map, runs, tmp_path):
    """A lasso drawn with real mouse events, downloaded with the page's button, excludes exactly those examples
    in curate; a clicked cluster row, copied from the page, keeps exactly that cluster."""
    data = page_data(single_map.html)
    browser.open(single_map.html)
    browser.downloads_to(tmp_path)
    screen = np.array(browser.evaluate("D.x.map((_, i) => toScreen(i, frame()))"))

    def clear_edge(coordinates: np.ndarray, near: float) -> int:
        """A whole pixel near `near` that no point sits within a pixel of: mouse events land on whole pixels."""
        return max(range(int(near) - 20, int(near) + 21), key=lambda c: np.abs(coordinates - c).min())

    left, top = (clear_edge(screen[:, k], v) for k, v in enumerate(np.percentile(screen, 20, axis=0)))
    right, bottom = (clear_edge(screen[:, k], v) for k, v in enumerate(np.percentile(screen, 60, axis=0)))
    inside = (screen[:, 0] > left) & (screen[:, 0] < right) & (screen[:, 1] > top) & (screen[:, 1] < bottom)
    assert 10 < inside.sum() < 600
    browser.click(*browser.center_of("#lasso"))
    corners = [(left, top), (right, top), (right, bottom), (left, bottom)]
    browser.mouse("mousePressed", *corners[0], button="left", clickCount=1)
    for (x0, y0), (x1, y1) in zip(corners, corners[1:] + corners[:1]):
        for t in np.linspace(0.1, 1.0, 5):
            browser.mouse("mouseMoved", x0 + (x1 - x0) * t, y0 + (y1 - y0) * t, button="left")
    browser.mouse("mouseReleased", *corners[0], button="left", clickCount=1)
    lassoed = sorted(np.asarray(data["index"])[inside].tolist())
    assert text(browser, "match-count") == str(len(lassoed))
    browser.click(*browser.center_of("#export"))
    download = tmp_path / "selection.json"
    deadline = time.monotonic() + 30
    while not (download.is_file() and download.stat().st_size) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert json.loads(download.read_text())["ids"] == lassoed

    excluded = curate(runs[0], tmp_path / "excluded", CurateOptions(exclude_ids=str(download)))
    assert excluded["dropped"] == {"excluded": len(lassoed)} and excluded["kept"] == 619 - len(lassoed)
    removed = [json.loads(line) for line in (tmp_path / "excluded" / REMOVED_FILE).read_text().splitlines()]
    assert sorted(r["index"] for r in removed) == lassoed

    browser.click(*browser.center_of("tr.cluster-row[data-cluster='2']"))
    copied = tmp_path / "cluster.json"
    copied.write_text(browser.evaluate("document.getElementById('selection-json').value"))
    members = sorted(np.asarray(data["index"])[np.asarray(data["cluster"]) == 2].tolist())
    assert json.loads(copied.read_text())["ids"] == members
    included = curate(runs[0], tmp_path / "included", CurateOptions(include_ids=str(copied)))
    assert included["kept"] == len(members) and included["dropped"] == {"not_included": 619 - len(members)}
    assert browser.errors == []


# ---------------------------------------------------------------- colour by any score

@pytest.fixture
def scored_run(tmp_path) -> Path:
    """60 points with inference's scores: ifd (missing on one), a loss change of both signs, the checker's agreement
    and answer, and a boolean record field."""
    rng = np.random.default_rng(0)
    ifd = np.linspace(0.5, 1.1, 60)
    ifd[7] = np.nan
    return write_inference_run(tmp_path / "run", rng.standard_normal((60, 8)).astype(np.float32),
                               rng.gamma(2.0, 1.0, 60), [f"prompt {i}" for i in range(60)], ifd=ifd,
                               loss_change=np.linspace(-2.0, 1.0, 60), agreement=(np.arange(60) % 3 == 0) * 1.0,
                               model_answer=[f"answer {i}" for i in range(60)], planted=[i % 10 == 0 for i in range(60)])


def test_every_numeric_column_is_a_colour_scale(scored_run, tmp_path):
    result = build_map(scored_run, tmp_path / "map.html", layout="pca", n_clusters=3, color="ifd")
    data = page_data(result.html)
    assert list(data["scales"]) == ["loss", "n_tokens", "ifd", "loss_change", "agreement", "planted"]
    assert data["color"] == "ifd" and data["scales"]["ifd"]["title"] == "ifd"
    ifd = data["scales"]["ifd"]["code"]
    assert ifd[7] == BINS and ifd[0] == 0 and ifd[59] == BINS - 1  # missing, lowest, highest
    assert ifd == sorted(ifd[:7]) + [BINS] + sorted(ifd[8:])  # a ramp in the order of the values
    # Values of both signs: the diverging scale, 0 in its middle.
    change = np.linspace(-2.0, 1.0, 60)
    codes = np.asarray(data["scales"]["loss_change"]["code"])
    assert (codes[change < -0.1] < BINS // 2).all() and (codes[change > 0.1] >= BINS // 2).all()
    assert data["values"]["ifd"][7] is None and data["values"]["ifd"][0] == 0.5
    assert data["values"]["planted"][:11] == [1.0] + [0.0] * 9 + [1.0]
    assert data["model_answer"][3] == "answer 3"
    # The PNG is drawn in the colour the page opens with: ifd's ramp, not the loss's.
    expected = page_data(build_map(scored_run, tmp_path / "loss.html", layout="pca", n_clusters=3).html)
    assert expected["color"] == "loss"
    assert not np.array_equal(np.asarray(Image.open(result.png)), np.asarray(Image.open(tmp_path / "loss.png")))
    with pytest.raises(UserError, match=r"^--color nope: .* has no numeric column 'nope'; it has loss, n_tokens, "
                                        r"ifd, loss_change, agreement, planted$"):
        build_map(scored_run, tmp_path / "x.html", layout="pca", color="nope")


@pytest.mark.integration
@pytest.mark.slow
def test_the_page_colours_by_a_score_and_shows_it_on_hover(browser, scored_run, tmp_path):
    result = build_map(scored_run, tmp_path / "map.html", layout="pca", n_clusters=3, color="agreement")
    browser.open(result.html, fragment="#point=train:3")
    assert browser.evaluate("document.getElementById('color-by').value") == "agreement"
    assert browser.evaluate("[...document.getElementById('color-by').options].map(o => o.value)") == \
        ["loss", "cluster", "source", "split", "n_tokens", "ifd", "loss_change", "agreement", "planted"]
    assert browser.evaluate("document.querySelector('#legend .legend-title').textContent") == "agreement"
    card = text(browser, "tip")
    assert "\nifd 0.5305  loss_change -1.8475  agreement 1.0000  planted 0.0000\ncluster " in card
    assert card.endswith("\nresponse: response 3\nmodel's answer: answer 3")
    browser.evaluate("(() => { const s = document.getElementById('color-by'); s.value = 'loss_change'; "
                     "s.dispatchEvent(new Event('change')); })()")
    assert browser.evaluate("document.querySelector('#legend .legend-title').textContent") == "loss_change"
    assert text(browser, "rendered-count") == "60"
    assert browser.errors == []


# ---------------------------------------------------------------- 100k points

@pytest.mark.integration
@pytest.mark.slow
def test_a_hundred_thousand_points_render_without_errors(browser, tmp_path):
    rng = np.random.default_rng(0)
    n = 100_000
    prompts = [f"planted prompt {i}" for i in range(n)]
    prompts[7] = "</script><script>document.title='broken'</script> a prompt that tries to end the data"
    folder = write_inference_run(tmp_path / "big", rng.standard_normal((n, 16)).astype(np.float32),
                                 rng.gamma(2.0, 1.0, n), prompts)
    result = build_map(folder, tmp_path / "big.html", layout="pca", n_clusters=12)
    browser.open(result.html, fragment="#search=tries%20to%20end")
    assert text(browser, "rendered-count") == text(browser, "point-count") == str(n)
    assert text(browser, "match-count") == "1"
    assert len(cluster_rows(browser)) == 12
    assert browser.evaluate("document.title") != "broken"
    assert browser.errors == []


# ---------------------------------------------------------------- layout and clusters on planted structure

@pytest.mark.slow
def test_umap_separates_planted_clusters_deterministically():
    import torch
    from sklearn.neighbors import NearestNeighbors

    x, truth = planted(n_per=50, n_clusters=20)
    features = embedding_features(x)
    threads = torch.get_num_threads()
    layout = layout_points(features, "umap", seed=0)
    # numba's OpenMP pool would have raised torch's threads: training after a map, in one process, 15x slower
    assert torch.get_num_threads() == threads

    def neighbour_agreement(points):  # share of each point's 10 nearest 2-D neighbours from its own cluster
        _, found = NearestNeighbors(n_neighbors=11).fit(points).kneighbors(points)
        return (truth[found[:, 1:]] == truth[:, None]).mean()

    assert neighbour_agreement(features[:, :2]) < 0.9  # PCA's first two components pile clusters together
    assert neighbour_agreement(layout) > 0.98
    assert layout.min() >= 0.0 and layout.max() <= 1.0
    assert np.array_equal(layout, layout_points(features, "umap", seed=0))


def test_clusters_recover_planted_groups_numbered_by_mean_loss():
    x, truth = planted(n_clusters=5, dim=20)
    loss = truth.astype(np.float64)  # planted group 4 is the hardest
    found = cluster_points(embedding_features(x), loss, 5)
    # a bijection between planted and found clusters, and cluster 0 holds the highest mean loss
    pairs = set(zip(truth.tolist(), found.tolist()))
    assert len(pairs) == 5 and len({t for t, _ in pairs}) == len({f for _, f in pairs}) == 5
    assert (4, 0) in pairs and (0, 4) in pairs


def test_cluster_labels_are_the_distinctive_prompt_words():
    prompts = ([f"Why does the volcano erupt lava, question {i}?" for i in range(6)]
               + [f"Which guitar chords for a ballad, question {i}?" for i in range(6)]
               + [f"How do tides follow the moon, question {i}?" for i in range(6)])
    labels = np.array([0] * 6 + [1] * 6 + [2] * 6)
    words = cluster_labels(prompts, labels)
    assert set(words[0].split(", ")) == {"volcano", "erupt", "lava"}
    assert set(words[1].split(", ")) == {"guitar", "chords", "ballad"}  # "question" is everywhere: no label
    assert set(words[2].split(", ")) == {"tides", "follow", "moon"}


def test_loss_change_matches_rows_by_split_and_index(tmp_path):
    emb = np.zeros((3, 4), dtype=np.float32)
    splits = ["train", "train", "val"]
    base = write_inference_run(tmp_path / "a", emb, np.array([1.0, 2.0, 3.0]), ["t0", "t1", "v0"], split=splits,
                               index=np.array([0, 1, 0]))
    # the other run lists its rows in another order, lacks train 1, and has a train 7 the base lacks
    other = write_inference_run(tmp_path / "b", emb, np.array([0.5, 1.5, 9.0]), ["v0", "t0", "t7"],
                                split=["val", "train", "train"], index=np.array([0, 0, 7]))
    np.testing.assert_array_equal(loss_change(load_run(base), load_run(other)), [-0.5, np.nan, 2.5])
    wrong = write_inference_run(tmp_path / "c", emb, np.array([1.0, 2.0, 3.0]), ["t0", "t1", "not v0"],
                                split=splits, index=np.array([0, 1, 0]))
    with pytest.raises(UserError, match="different prompts"):
        loss_change(load_run(base), load_run(wrong))


def test_missing_input_is_a_one_line_error(tmp_path, capsys):
    from gpt4all_training.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["build_map", "--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "map.html")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --input {tmp_path / 'nothing'}: no inference output")


def test_two_maps_in_one_folder_keep_their_own_cluster_tables_and_show_progress(tmp_path, capsys, monkeypatch):
    """`build_map --output a.html` then `--output b.html` from the current folder: each cluster table lands beside
    its own page, named after it, and neither overwrites the other; each stage says what it does on stderr."""
    from gpt4all_training.cli.main import main

    rng = np.random.default_rng(0)
    inputs = [write_inference_run(tmp_path / name, rng.standard_normal((60, 8)).astype(np.float32),
                                  rng.gamma(2.0, 1.0, 60), [f"{name} prompt {i}" for i in range(60)])
              for name in ("a", "b")]
    monkeypatch.chdir(tmp_path)
    for folder in inputs:
        with pytest.raises(SystemExit) as exit_info:
            main(["build_map", "--input", str(folder), "--output", f"{folder.name}.html", "--layout", "pca",
                  "--clusters", "3"])
        assert exit_info.value.code == 0
        captured = capsys.readouterr()
        assert [re.sub(r" \([\d.]+ s\)$", "", line) for line in captured.err.splitlines()] == [
            f"build_map: read 60 points from {folder / 'inference.parquet'}",
            "build_map: features of 60 embeddings (PCA)",
            "build_map: layout of 60 points (pca)",
            "build_map: 3 clusters (k-means) and their labels",
            f"build_map: wrote {folder.name}.html, {folder.name}.png and {folder.name}.clusters.csv"]
        assert f"wrote {folder.name}.clusters.csv" in captured.out
    assert not (tmp_path / "clusters.csv").exists()
    tables = [(tmp_path / f"{name}.clusters.csv").read_text() for name in ("a", "b")]
    assert tables[0] != tables[1] and all(table.count("\n") == 4 for table in tables)
