"""`gpt4all-training build_map`: an interactive HTML map of an inference run (see gpt4all_training/analysis/map)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from gpt4all_training.analysis.map.build import build_map
from gpt4all_training.analysis.map.layout import LAYOUTS
from gpt4all_training.errors import UserError


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


def require_writable_file(flag: str, path: Path) -> None:
    """Create the folder of an output file and prove a file can be written there, before the minutes of layout."""
    if path.is_dir():
        raise UserError(f"{flag} {path}: is a folder; give a file path, e.g. {path / 'map.html'}")
    existing = next(folder for folder in path.absolute().parents if folder.exists())
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: {existing} is a file, not a folder; choose another path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write there ({exc.strerror or type(exc).__name__}); choose another "
                        f"path") from None


def run(args: argparse.Namespace) -> int:
    if args.clusters is not None and args.clusters < 1:
        raise UserError(f"--clusters: must be at least 1, got {args.clusters}")
    if args.text_chars < 10:
        raise UserError(f"--text-chars: must be at least 10, got {args.text_chars}")
    for flag, path in (("--output", args.output), ("--png", args.png), ("--clusters-csv", args.clusters_csv)):
        if path:
            require_writable_file(flag, Path(path))
    result = build_map(args.input, args.output, args.compare, args.clusters, args.layout, args.seed,
                       args.text_chars, args.png, args.clusters_csv, args.color)
    hardest = result.clusters[0]
    print(f"{result.n_points} points, {len(result.clusters)} clusters; highest mean loss: cluster "
          f"{hardest['cluster']} ({hardest['label']}) {hardest['mean_loss']}")
    print(f"wrote {result.html}")
    print(f"wrote {result.png}")
    print(f"wrote {result.clusters_csv}")
    return 0
