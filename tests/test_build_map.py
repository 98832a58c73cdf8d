"""build_map.py: the NumPy reduction and clustering on planted structure, and the page itself rendered by a real
headless Chromium (Debian's package, installed by scripts/ensure_chromium.sh) from inference runs of the tiny
model: point count, cluster table, search, --compare, and a screenshot that is not blank."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image  # installed with tensorboard (requirements.txt); an independent PNG decoder

from support.models import build_tiny_gptj
from support.paths import REPO
from gpt4all_training.analysis.map.build import build_map
from gpt4all_training.analysis.map.clusters import cluster_labels, kmeans
from gpt4all_training.analysis.map.layout import nearest_neighbors, neighbor_layout, pca
from gpt4all_training.analysis.map.render import BACKGROUND, encode_png, truncate
from gpt4all_training.analysis.map.runs import load_run, loss_change
from gpt4all_training.errors import UserError
from gpt4all_training.analysis.inference import embedding_array, run_inference
from gpt4all_training.config.schemas import InferenceConfig

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--no-first-run", "--disable-sync", "--hide-scrollbars",
                  "--window-size=1280,800"]


# ---------------------------------------------------------------- helpers

def write_run(folder: Path, embeddings: np.ndarray, loss: np.ndarray, prompts: list[str], **columns) -> Path:
    """An inference.parquet with inference.py's schema, for planted data."""
    n = len(loss)
    table = pa.table({
        "source": columns.get("source", ["synthetic"] * n), "prompt": prompts,
        "response": columns.get("response", [f"response {i}" for i in range(n)]),
        "index": columns.get("index", np.arange(n)), "split": columns.get("split", ["train"] * n),
        "loss": loss, "n_tokens": columns.get("n_tokens", np.full(n, 5)), "embedding": embedding_array(embeddings)})
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, folder / "inference.parquet")
    return folder


VOID_TAGS = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Dom(HTMLParser):
    """Text of elements by id, and the cells of each cluster-table row, from Chromium's --dump-dom."""

    def __init__(self, html: str):
        super().__init__()
        self.text: dict[str, str] = {}
        self.rows: list[list[str]] = []
        self.headers: list[str] = []
        self.options: list[str] = []
        self.body_attrs: dict[str, str] = {}
        self._open: list[str | None] = []
        self._cell: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "body":
            self.body_attrs = attrs
        if tag == "tr" and "cluster-row" in (attrs.get("class") or ""):
            self.rows.append([])
        if tag in ("td", "th", "option"):
            self._cell = []
        if tag not in VOID_TAGS:
            self._open.append(attrs.get("id"))

    def handle_endtag(self, tag):
        if tag in ("td", "th", "option") and self._cell is not None:
            text = "".join(self._cell).strip()
            if tag == "td" and self.rows:
                self.rows[-1].append(text)
            elif tag == "th":
                self.headers.append(text)
            else:
                self.options.append(text)
            self._cell = None
        if self._open:
            self._open.pop()

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        for element_id in self._open:
            if element_id:
                self.text[element_id] = self.text.get(element_id, "") + data


def page_data(html_path: Path) -> dict:
    html = html_path.read_text(encoding="utf-8")
    raw = re.search(r'<script type="application/json" id="map-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(raw)


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's chromium; installed on first use when missing (the script needs root and the package mirror)."""
    found = shutil.which("chromium")
    if not found:
        result = subprocess.run(["bash", str(REPO / "scripts" / "ensure_chromium.sh")], capture_output=True,
                                text=True, timeout=1200)
        found = shutil.which("chromium")
        if not found:
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
            pytest.skip(f"chromium is not installed and scripts/ensure_chromium.sh failed: {tail[0]}")
    return found


def browse(chromium: str, page: Path, tmp_path: Path, *action: str, fragment: str = "") -> subprocess.CompletedProcess:
    profile = tmp_path / f"chromium-profile-{len(list(tmp_path.glob('chromium-profile-*')))}"
    result = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *action,
                             page.resolve().as_uri() + fragment], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def rendered(chromium: str, page: Path, tmp_path: Path, fragment: str = "") -> Dom:
    return Dom(browse(chromium, page, tmp_path, "--dump-dom", fragment=fragment).stdout)


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
def test_map_renders_every_point_and_the_cluster_table(chromium, single_map, tmp_path):
    dom = rendered(chromium, single_map.html, tmp_path)
    assert dom.body_attrs.get("data-ready") == "1"
    assert dom.text["point-count"] == dom.text["rendered-count"] == "619"
    assert len(dom.rows) == 8
    # Sorted by mean loss, hardest first, and the same as clusters.csv.
    means = [float(row[3]) for row in dom.rows]
    assert means == sorted(means, reverse=True)
    with open(single_map.clusters_csv, encoding="utf-8") as f:
        header, *lines = [line.rstrip("\n") for line in f]
    assert header == "cluster,label,size,mean_loss,median_loss,mean_n_tokens,top_source,train,val"
    csv_clusters = [line.split(",")[0] for line in lines]
    assert [row[0] for row in dom.rows] == csv_clusters
    assert sum(int(row[2]) for row in dom.rows) == 619
    assert dom.options == ["loss", "cluster", "source", "split"]


@pytest.mark.integration
def test_page_loads_nothing_from_the_network(single_map):
    html = single_map.html.read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", html)
    assert "<link" not in html and "@import" not in html and "url(" not in html


@pytest.mark.integration
def test_screenshot_is_not_blank(chromium, single_map, tmp_path):
    shot = tmp_path / "map-screenshot.png"
    browse(chromium, single_map.html, tmp_path, f"--screenshot={shot}")
    pixels = np.asarray(Image.open(shot).convert("RGB"))
    assert pixels.shape == (800, 1280, 3)
    plot = pixels[:, :880]  # the canvas; the side panel is 380 px wide
    drawn = np.any(plot != np.array(BACKGROUND, dtype=np.uint8), axis=-1)
    assert 0.002 < drawn.mean() < 0.5
    assert len(np.unique(plot.reshape(-1, 3), axis=0)) >= 20  # a loss ramp, not one flat colour


@pytest.mark.integration
def test_search_highlights_exactly_the_matching_points(chromium, single_map, runs, tmp_path):
    run = load_run(runs[0])
    texts = [(p + "\n" + r).lower() for p, r in zip(truncate(run.prompt, 240), truncate(run.response, 240))]
    expected = sum("water" in t for t in texts)
    assert 0 < expected < 619
    dom = rendered(chromium, single_map.html, tmp_path, fragment="#search=water&colour=source")
    assert dom.text["match-count"] == str(expected)
    assert dom.text["rendered-count"] == "619"  # dimmed points are still drawn


@pytest.mark.integration
def test_hover_card_shows_the_example(chromium, single_map, runs, tmp_path):
    data = page_data(single_map.html)
    xy = np.stack([data["x"], data["y"]], axis=1)
    gaps = np.sqrt(((xy[:, None] - xy[None]) ** 2).sum(-1) + np.eye(len(xy)) * 9).min(axis=1)
    loneliest = int(gaps.argmax())  # no other point within the 8-pixel hover radius
    assert gaps[loneliest] > 0.02
    split, index = data["splits"][data["split"][loneliest]], data["index"][loneliest]
    dom = rendered(chromium, single_map.html, tmp_path, fragment=f"#point={split}:{index}")
    card = dom.text["tip"]
    assert card.startswith(f"{split} #{index}  source {data['sources'][data['source'][loneliest]]}\nloss ")
    assert f"\nprompt: {data['prompt'][loneliest]}\nresponse: {data['response'][loneliest]}" in card


@pytest.mark.integration
def test_static_png_has_the_points_and_decodes(single_map):
    image = np.asarray(Image.open(single_map.png).convert("RGB"))
    assert image.shape == (800, 1000, 3)
    assert np.any(image != np.array(BACKGROUND, dtype=np.uint8), axis=-1).sum() >= 619  # at least a pixel each


@pytest.mark.integration
def test_compare_colors_by_loss_change(chromium, runs, tmp_path):
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
    dom = rendered(chromium, result.html, tmp_path)
    assert dom.text["rendered-count"] == "619"
    assert dom.options[-1] == "loss change"
    assert dom.headers[-1].startswith("mean change")


# ---------------------------------------------------------------- tens of thousands of points

@pytest.mark.integration
def test_twenty_thousand_points_render(chromium, tmp_path):
    rng = np.random.default_rng(0)
    n = 20_000
    prompts = [f"planted prompt {i}" for i in range(n)]
    prompts[7] = "</script><script>document.title='broken'</script> a prompt that tries to end the data"
    folder = write_run(tmp_path / "big", rng.standard_normal((n, 32)).astype(np.float32), rng.gamma(2.0, 1.0, n),
                       prompts)
    result = build_map(folder, tmp_path / "big.html", layout="pca", n_clusters=12)
    dom = rendered(chromium, result.html, tmp_path, fragment="#search=tries%20to%20end")
    assert dom.text["rendered-count"] == dom.text["point-count"] == str(n)
    assert dom.text["match-count"] == "1"
    assert len(dom.rows) == 12


# ---------------------------------------------------------------- the NumPy parts on planted structure

def planted(n_per: int = 100, n_clusters: int = 10, dim: int = 100, seed: int = 0):
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((n_clusters, dim)) * 2.0
    labels = np.repeat(np.arange(n_clusters), n_per)
    return (centres[labels] + rng.standard_normal((len(labels), dim))).astype(np.float32), labels


def test_kmeans_recovers_planted_clusters():
    x, truth = planted(n_clusters=5, dim=20)
    found = kmeans(x, 5, seed=0)
    # a bijection between planted and found clusters
    pairs = set(zip(truth.tolist(), found.tolist()))
    assert len(pairs) == 5 and len({t for t, _ in pairs}) == len({f for _, f in pairs}) == 5


def test_neighbor_layout_separates_what_pca_overlaps():
    x, truth = planted(n_per=50, n_clusters=20)
    features = pca(x, 50)
    first_two = features[:, :2]
    layout = neighbor_layout(features, first_two, seed=0)

    def neighbour_agreement(points):  # share of each point's 10 nearest 2-D neighbours from its own cluster
        return (truth[nearest_neighbors(points.astype(np.float32), 10)] == truth[:, None]).mean()

    assert neighbour_agreement(first_two) < 0.9
    assert neighbour_agreement(layout) > 0.98
    assert np.array_equal(layout, neighbor_layout(features, first_two, seed=0))  # deterministic


def test_pca_matches_the_exact_decomposition():
    # 200 columns with a decaying spectrum (the randomised path), and 40 columns (the range is the whole space)
    rng = np.random.default_rng(1)
    for x, k in ((rng.standard_normal((300, 200)) @ np.diag(1.0 / np.arange(1, 201)), 2),
                 (rng.standard_normal((300, 40)), 30)):
        u, s, _ = np.linalg.svd(x - x.mean(axis=0), full_matrices=False)
        exact = u[:, :k] * s[:k]
        ours = pca(x, k)
        np.testing.assert_allclose(np.abs(ours), np.abs(exact), atol=1e-5 * s[0])


def test_nearest_neighbors_are_exact():
    x = np.random.default_rng(2).standard_normal((700, 8)).astype(np.float32)
    distances = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(distances, np.inf)
    expected = np.sort(np.argsort(distances, axis=1)[:, :5], axis=1)
    np.testing.assert_array_equal(np.sort(nearest_neighbors(x, 5, block=128), axis=1), expected)


def test_cluster_labels_are_the_distinctive_prompt_words():
    prompts = ([f"Why does the volcano erupt lava number {i}?" for i in range(6)]
               + [f"Which guitar chords fit song number {i}?" for i in range(6)])
    labels = np.array([0] * 6 + [1] * 6)
    words = cluster_labels(prompts, labels)
    assert set(words[0].split(", ")) == {"volcano", "erupt", "lava"}
    assert set(words[1].split(", ")) == {"guitar", "chords", "fit"}  # "number" is in both: not distinctive


def test_png_encoder_round_trips(tmp_path):
    image = np.random.default_rng(3).integers(0, 256, (7, 11, 3), dtype=np.uint8)
    data = encode_png(image)
    (tmp_path / "roundtrip.png").write_bytes(data)
    np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "roundtrip.png").convert("RGB")), image)
    assert zlib.crc32(data[-8:-4]) == int.from_bytes(data[-4:], "big")  # IEND's CRC


def test_loss_change_matches_rows_by_split_and_index(tmp_path):
    emb = np.zeros((3, 4), dtype=np.float32)
    splits = ["train", "train", "val"]
    base = write_run(tmp_path / "a", emb, np.array([1.0, 2.0, 3.0]), ["t0", "t1", "v0"], split=splits,
                     index=np.array([0, 1, 0]))
    # the other run lists its rows in another order, lacks train 1, and has a train 7 the base lacks
    other = write_run(tmp_path / "b", emb, np.array([0.5, 1.5, 9.0]), ["v0", "t0", "t7"],
                      split=["val", "train", "train"], index=np.array([0, 0, 7]))
    np.testing.assert_array_equal(loss_change(load_run(base), load_run(other)), [-0.5, np.nan, 2.5])
    wrong = write_run(tmp_path / "c", emb, np.array([1.0, 2.0, 3.0]), ["t0", "t1", "not v0"], split=splits,
                      index=np.array([0, 1, 0]))
    with pytest.raises(UserError, match="different prompts"):
        loss_change(load_run(base), load_run(wrong))


def test_missing_input_is_a_one_line_error(tmp_path, capsys):
    from gpt4all_training.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["build_map", "--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "map.html")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: --input {tmp_path / 'nothing'}: no inference output")
