"""From an inference run to a better dataset: `gpt4all-training curate --input INFERENCE_DIR --output DIR ...`.

Rules, applied in this order, each record counted under the first rule that drops it (`kept + dropped == read`):
1. `--include-ids FILE` / `--exclude-ids FILE`: example ids chosen on the map (a lasso, a cluster, a search; the
   page's "download ids" writes the file);
2. `--loss-above Q` / `--loss-below Q`: per-example losses above (below) the run's Q quantile, where broken labels
   and trivial records show up after training;
3. `--drop RULE`, in the order given: a rule on any numeric column of the run (the scores inference writes: ifd,
   loss_change, agreement, outlier, ...), `COLUMN OP VALUE` with OP one of > >= < <=, VALUE a number or `qX` (the
   column's X quantile over every record read), conditions joined by `&` all to be met: `ifd>q0.9`,
   `agreement<1&loss>q0.8`. A record whose value is missing (NaN) is never dropped by a rule on it;
4. `--near-duplicates COSINE`: exact duplicates first, then SemDeDup: the records are partitioned by k-means on
   their sentence embeddings, and within each partition a record whose cosine similarity to an earlier kept record
   reaches COSINE is dropped (the first record of every group in dataset order stays).

Given the known-bad records (`--label-column COLUMN`, true for them, or `--label-ids FILE`), the report gives the
precision and recall of everything dropped and of what each rule found on its own.

Modules: embeddings (all-MiniLM-L6-v2, or the run's own), rules (the pure functions of each rule), curate (reading
the run, applying the rules, writing DIR/<name>_clean.jsonl, curate_report.json and curate_removed.jsonl).
"""
