"""`gpt4all-training curate`: an inference run to a new, smaller dataset (see gpt4all_training/analysis/curation)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, Optional

from gpt4all_training.analysis.curation.curate import REPORT_FILE, CurateOptions, curate
from gpt4all_training.analysis.curation.embeddings import EMBEDDERS
from gpt4all_training.analysis.inference import SCORE_COLUMNS
from gpt4all_training.files import writable_folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="an inference output_dir (or its inference.parquet)")
    parser.add_argument("--output", required=True,
                        help="folder for <name>_clean.jsonl (train on it with dataset_path=FOLDER), "
                             f"{REPORT_FILE} and curate_removed.jsonl")
    parser.add_argument("--near-duplicates", type=float, metavar="COSINE",
                        help="drop exact duplicates, then records whose embedding's cosine similarity to an "
                             "earlier kept record reaches COSINE (e.g. 0.9); the report shows the similarity "
                             "distribution to choose it on")
    parser.add_argument("--embedder", choices=EMBEDDERS, default="minilm",
                        help="embeddings for --near-duplicates: all-MiniLM-L6-v2 sentence embeddings of prompt and "
                             "response (default), or the inference run's own hidden states")
    parser.add_argument("--loss-above", type=float, metavar="QUANTILE",
                        help="drop records whose loss is above this quantile of the run's losses (e.g. 0.95): "
                             "broken labels, after training")
    parser.add_argument("--loss-below", type=float, metavar="QUANTILE",
                        help="drop records whose loss is below this quantile (e.g. 0.02): trivial or memorised")
    parser.add_argument("--drop", action="append", default=[], metavar="RULE",
                        help="drop the records meeting RULE, a rule on any numeric column of the run (repeat it for "
                             "more rules; quote it for the shell): COLUMN OP VALUE with OP one of > >= < <= and "
                             "VALUE a number or qX, the column's X quantile, conditions joined by & all to be met: "
                             "'ifd>q0.9', 'loss_change<-1', 'agreement<1&loss>q0.8'. The scores: "
                             f"{', '.join(SCORE_COLUMNS)} (inference's config says which it writes), loss, n_tokens")
    parser.add_argument("--label-column", metavar="COLUMN",
                        help="a column of the run (a record field) that is true for the known-bad records: the report "
                             "gives the precision and recall of what was dropped, and of each rule on its own")
    parser.add_argument("--label-ids", metavar="FILE",
                        help="the known-bad records' ids instead (the formats of --exclude-ids)")
    parser.add_argument("--include-ids", metavar="FILE", help="keep only these example ids (the map's 'download "
                                                               "ids' file, a JSON list, or one id per line)")
    parser.add_argument("--exclude-ids", metavar="FILE", help="drop these example ids (same formats)")
    parser.add_argument("--name", default="curated", help="the dataset file is OUTPUT/<name>_clean.jsonl")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the k-means partitions and of the report's clusters (those of a map built "
                             "with the same --seed)")


def shown_share(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """curate's report: read, kept and dropped by reason, the rules' thresholds, and the dataset file written."""
    writable_folder("--output", args.output)  # before the embeddings and the rules
    options = CurateOptions(args.near_duplicates, args.embedder, args.loss_above, args.loss_below, args.include_ids,
                            args.exclude_ids, args.name, args.seed, args.drop, args.label_column, args.label_ids)
    return curate(args.input, args.output, options)


def run(args: argparse.Namespace) -> int:
    report = execute(args)
    reasons = ", ".join(f"{k} {v}" for k, v in report["dropped"].items()) or "none"
    print(f"read {report['read']}, kept {report['kept']}, dropped {report['dropped_total']} ({reasons})")
    for name, rule in report["rules"].items():
        if name.startswith("loss_"):
            print(f"{name}: quantile {rule['quantile']} is loss {rule['loss']}")
    for rule in report["rules"].get("drop", []):
        thresholds = ", ".join(f"{c['column']} {c['op']} {c['threshold']:.6g}" for c in rule["conditions"])
        print(f"{rule['rule']}: {thresholds}; matched {rule['matched']}, dropped {rule['dropped']}")
    label = report.get("label")
    if label:
        print(f"known bad ({label['from']}): {label['bad']}; dropped {label['dropped_bad']} of them "
              f"(precision {shown_share(label['precision'])}, recall {shown_share(label['recall'])})")
        for reason, found in label["by_rule"].items():
            print(f"  {reason} on its own: matched {found['matched']}, precision {shown_share(found['precision'])}, "
                  f"recall {shown_share(found['recall'])}")
    near = report["rules"].get("near_duplicates")
    if near and near["nearest_similarity"].get("records"):
        print(f"nearest-neighbour cosine similarity ({near['embedder']}), over {near['nearest_similarity']['records']} "
              f"records:")
        for bin_ in near["nearest_similarity"]["histogram"]:
            print(f"  {bin_['from']:>5} .. {bin_['to']:<5} {bin_['records']}")
    for entry in report["removed_by_cluster"][:5]:
        print(f"cluster {entry['cluster']} ({entry['label']}): removed {entry['removed']} of {entry['size']}")
    print(f"wrote {report['output']}")
    print(f"report: {Path(args.output) / REPORT_FILE}")
    return 0
