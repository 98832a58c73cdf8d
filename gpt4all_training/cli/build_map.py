"""`gpt4all-training build_map`: an interactive HTML map of an inference run (see gpt4all_training/analysis/map)."""

from __future__ import annotations

import argparse

from gpt4all_training.analysis.map.build import MapResult, build_map
from gpt4all_training.analysis.map.layout import LAYOUTS
from gpt4all_training.errors import UserError
from gpt4all_training.files import writable_file


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="an inference output_dir (or its inference.parquet)")
    parser.add_argument("--output", required=True, help="the HTML file to write, e.g. map.html")
    parser.add_argument("--compare", help="another inference run over the same data: colour by loss change "
                                          "(input minus compare) on the input's layout")
    parser.add_argument("--color", metavar="COLUMN",
                        help="the numeric column the page opens coloured by and the PNG is drawn in: loss (default), "
                             "n_tokens, a score inference wrote (ifd, loss_change, agreement, outlier, ...), or "
                             "'loss change' with --compare (its default); the page can switch to any of them")
    parser.add_argument("--clusters", type=int, help="number of clusters (default: about sqrt(n/4), at most 40)")
    parser.add_argument("--layout", choices=LAYOUTS, default="umap",
                        help="UMAP of the embeddings' PCA features (default), or their first two principal "
                             "components (a quick look at very large runs)")
    parser.add_argument("--seed", type=int, default=0, help="seed for PCA, UMAP and k-means: the same seed and "
                                                            "input give the same map")
    parser.add_argument("--text-chars", type=int, default=240, help="prompt/response characters kept for hover")
    parser.add_argument("--png", help="static image path (default: the output with .png)")
    parser.add_argument("--clusters-csv", help="cluster table path (default: beside the output, named after it: "
                                               "map.clusters.csv for map.html)")


def execute(args: argparse.Namespace) -> MapResult:
    if args.clusters is not None and args.clusters < 1:
        raise UserError(f"--clusters: must be at least 1, got {args.clusters}")
    if args.text_chars < 10:
        raise UserError(f"--text-chars: must be at least 10, got {args.text_chars}")
    for flag, path in (("--output", args.output), ("--png", args.png), ("--clusters-csv", args.clusters_csv)):
        if path:
            writable_file(flag, path, example="map.html")  # before the minutes of layout
    return build_map(args.input, args.output, args.compare, args.clusters, args.layout, args.seed,
                     args.text_chars, args.png, args.clusters_csv, args.color)


def run(args: argparse.Namespace) -> int:
    result = execute(args)
    hardest = result.clusters[0]
    print(f"{result.n_points} points, {len(result.clusters)} clusters; highest mean loss: cluster "
          f"{hardest['cluster']} ({hardest['label']}) {hardest['mean_loss']}")
    print(f"wrote {result.html}")
    print(f"wrote {result.png}")
    print(f"wrote {result.clusters_csv}")
    return 0
