"""A local, self-contained map of an inference run: where the model's embeddings put each example, and its loss.

`python build_map.py --input INFERENCE_DIR --output map.html [--compare OTHER_INFERENCE_DIR]` writes
- `map.html`: one file, every script and style inline, no network. Points are drawn on a canvas, so 100k stay
  responsive. Colour by loss, cluster, source or split, loss change with `--compare`, and any numeric column of the
  run (n_tokens, and the scores inference writes: ifd, loss_change, agreement, outlier, ...; `--color` picks the one
  it opens with); hover for the prompt and response, the scores and the model's own answer; a search box, a click
  on a cluster's row or a lasso (shift-drag) selects points, and "download ids" saves the selection as JSON for
  `gpt4all-training curate --exclude-ids/--include-ids`. The cluster table is sorted by mean loss, hardest first,
  which is where broken or hard data shows up. A link can carry a view:
  `map.html#color=source&search=volcano&point=val:12` (the last opens that example's hover card).
- `map.png` (next to the HTML): the same layout coloured as the page opens (loss, loss change or `--color`), with a
  colour bar and the cluster numbers.
- `map.clusters.csv` (next to the HTML, named after it): one row per cluster with its label, size and loss
  statistics.

Modules, in the order `build.build_map` uses them: runs (reading inference.parquet, the loss change), layout
(PCA with scikit-learn, UMAP with umap-learn), clusters (scikit-learn's k-means, class-based TF-IDF labels, the
cluster table), render (matplotlib's colour scales, the PNG, the page). The page is package data: page.html,
page.css and page.js, inlined into the one written file.
"""
