"""The map at 10k and 100k points: build time and page load in headless Chromium, this code against the map before
it (hand-written PCA, neighbour layout, k-means and PNG encoder: the package as of --old-ref, extracted with
`git archive` into a temporary folder), and our canvas page against a plotly WebGL page (Scattergl, plotly.js
inlined) of the same points, hover text and colours.

    .venv/bin/python bench/map.py [--sizes 10000 100000] [--old-ref 387ec64]

Each build runs in a fresh process (imports and umap-learn's numba kernels loaded from NUMBA_CACHE_DIR, as a user's
second run would); the numba warm-up itself is measured once, on 1,000 points, with an empty cache and with a warm
one. Page times, medians over 3 fresh loads: navigation to the first painted frame; a wheel zoom and a drag pan
(real input events over the DevTools protocol), each to the next painted frame, median of 5 per load. The load
average is read at the start and the end (2 shared cores: the figures move with it). Results go to
.cache/bench/map/results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the DevTools client the browser tests use

from support.browser import Browser, chromium_path  # noqa: E402

WORK = REPO / ".cache" / "bench" / "map"
DOLLY = Path(os.environ.get("GPT4ALL_SHARED_DATA", REPO.parent / "shared" / "data")) / "dolly-sample.jsonl"
OLD_REF = "387ec64"  # the last commit with the hand-written map
TOPICS = 40
ENV = {"NUMBA_CACHE_DIR": str(REPO / ".cache" / "numba"), "MPLCONFIGDIR": str(REPO / ".cache" / "matplotlib"),
       "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}

BUILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
started = time.perf_counter()
from gpt4all_training.analysis.map.build import build_map
import gpt4all_training
imported = time.perf_counter()
build_map(sys.argv[2], sys.argv[3])
print(json.dumps({"import_s": imported - started, "build_s": time.perf_counter() - imported,
                  "package": gpt4all_training.__file__}))
"""
WARMUP = """
import sys, time
import numpy as np
sys.path.insert(0, sys.argv[1])
from gpt4all_training.analysis.map.layout import layout_points
features = np.random.default_rng(0).standard_normal((1000, 50)).astype(np.float32)
started = time.perf_counter()
layout_points(features, "umap")
print(time.perf_counter() - started)
"""


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def planted_run(n: int) -> Path:
    """n Dolly records (cycled, numbered) with 64-d embeddings from TOPICS Gaussian topics and gamma losses."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = WORK / f"run-{n}"
    if (folder / "inference.parquet").is_file():
        return folder
    records = [json.loads(line) for line in DOLLY.read_text().splitlines()]
    rng = np.random.default_rng(0)
    topic = rng.integers(0, TOPICS, n)
    centres = rng.standard_normal((TOPICS, 64)) * 3.0
    embeddings = (centres[topic] + rng.standard_normal((n, 64))).astype(np.float32)
    picked = [records[i % len(records)] for i in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "source": [r.get("category", "dolly") for r in picked],
        "prompt": [f"{r['instruction']} (#{i})" for i, r in enumerate(picked)],
        "response": [r["response"] for r in picked], "index": np.arange(n), "split": ["train"] * n,
        "loss": rng.gamma(2.0, 1.0, n) + topic / TOPICS, "n_tokens": rng.integers(5, 200, n),
        "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embeddings.reshape(-1)), 64)}),
        folder / "inference.parquet")
    return folder


def extract_old(ref: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", ref, "gpt4all_training"], cwd=REPO, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def build(root: Path, run: Path, output: Path, env: dict[str, str]) -> dict:
    result = subprocess.run([sys.executable, "-c", BUILD, str(root), str(run), str(output)], capture_output=True,
                            text=True, env={**os.environ, **env}, timeout=3600)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert Path(measured.pop("package")).is_relative_to(root), "the build imported the wrong package"
    return measured


def plotly_page(html: Path, output: Path) -> None:
    """The points, loss colours and hover texts of one of our pages, as plotly would draw them."""
    import plotly.graph_objects as go

    text = html.read_text(encoding="utf-8")
    start = text.index('id="map-data">') + len('id="map-data">')
    data = json.loads(text[start:text.index("</script>", start)])
    hover = [f"#{i} loss {loss}<br>{p}<br>{r}" for i, loss, p, r in
             zip(data["index"], data["loss"], data["prompt"], data["response"])]
    figure = go.Figure(go.Scattergl(x=data["x"], y=data["y"], mode="markers", hovertext=hover, hoverinfo="text",
                                    marker={"size": 3, "color": data["loss"], "colorscale": "Turbo",
                                            "showscale": True}))
    figure.update_layout(dragmode="pan")
    figure.write_html(output, include_plotlyjs=True, config={"scrollZoom": True},
                      post_script="document.body.dataset.ready = '1';")


def page_times(browser: Browser, page: Path, repeats: int = 3) -> dict:
    """Medians over `repeats` fresh loads of the page: load to the first painted frame, and per load the median of
    5 wheel zooms and 5 drag steps, each to the next painted frame."""
    loads, zooms, pans = [], [], []
    x, y = 450, 400  # inside the plot of both pages
    for _ in range(repeats):
        started = time.perf_counter()
        browser.open(page)
        browser.wait_for("document.body.dataset.ready")
        browser.next_frame()
        loads.append(time.perf_counter() - started)
        each = []
        for _ in range(5):
            started = time.perf_counter()
            browser.mouse("mouseWheel", x, y, deltaX=0, deltaY=-120)
            browser.next_frame()
            each.append(time.perf_counter() - started)
        zooms.append(statistics.median(each))
        each = []
        browser.mouse("mousePressed", x, y, button="left", clickCount=1)
        for step in range(1, 6):
            started = time.perf_counter()
            browser.mouse("mouseMoved", x + 10 * step, y + 5 * step, button="left")
            browser.next_frame()
            each.append(time.perf_counter() - started)
        browser.mouse("mouseReleased", x + 50, y + 25, button="left", clickCount=1)
        pans.append(statistics.median(each))
    return {"mb": round(page.stat().st_size / 2**20, 1), "load_s": round(statistics.median(loads), 2),
            "zoom_ms": round(1000 * statistics.median(zooms)), "pan_ms": round(1000 * statistics.median(pans)),
            "errors": browser.errors[:3]}


def numba_warmup(root: Path) -> dict:
    """UMAP on 1,000 points in a fresh process: with an empty numba cache, then with the one that run filled."""
    with tempfile.TemporaryDirectory() as cache:
        times = [float(subprocess.run([sys.executable, "-c", WARMUP, str(root)], capture_output=True, text=True,
                                      check=True, env={**os.environ, **ENV, "NUMBA_CACHE_DIR": cache}
                                      ).stdout.split()[-1]) for _ in range(2)]
    return {"empty_cache_s": round(times[0], 1), "warm_cache_s": round(times[1], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--old-ref", default=OLD_REF, help="the commit whose map to compare with")
    args = parser.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    results = {"loadavg_start": loadavg(), "old_ref": args.old_ref, "sizes": {}}
    print(f"load average at start: {results['loadavg_start']}", flush=True)
    results["umap_warmup"] = numba_warmup(REPO)
    print(f"UMAP on 1,000 points in a fresh process: {results['umap_warmup']}", flush=True)
    executable = chromium_path()
    with tempfile.TemporaryDirectory() as old_root, Browser(executable) as browser:
        extract_old(args.old_ref, Path(old_root))
        for n in args.sizes:
            run = planted_run(n)
            row = {}
            for name, root in (("new", REPO), ("old", Path(old_root))):
                page = WORK / f"{name}-{n}.html"
                row[name] = build(root, run, page, ENV)
                row[name].update(page_times(browser, page))
                print(f"{n} {name}: {row[name]}", flush=True)
            plotly_page(WORK / f"new-{n}.html", WORK / f"plotly-{n}.html")
            row["plotly"] = page_times(browser, WORK / f"plotly-{n}.html")
            print(f"{n} plotly: {row['plotly']}", flush=True)
            results["sizes"][n] = row
    results["loadavg_end"] = loadavg()
    print(f"load average at end: {results['loadavg_end']}")
    (WORK / "results.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {WORK / 'results.json'}")


if __name__ == "__main__":
    main()
