"""clean.py streams: past what one record and the output buffers take, its memory grows by a digest per kept record
(the exact duplicates' set), not by the records. Each run is a fresh process that writes N or 4N records of about
1,000 characters each (every other one a duplicate of the one before it, dropped and written to --rejects), then
cleans them with its Python allocations traced (tracemalloc counts every object, whatever the allocator keeps),
without loading torch."""

from __future__ import annotations

import json
import subprocess

from support.paths import PYTHON, REPO

RECORDS = 4000
# A kept record's digest (a 16-byte bytes object) and its share of the set's table, with room for the table's
# doubling; a record held in memory instead (its dict and three strings) takes over 1,000 bytes.
BYTES_PER_RECORD = 256

RUN = """
import json, sys, tracemalloc
from gpt4all_training.data.clean import clean

count, folder = int(sys.argv[1]), sys.argv[2]
with open(f"{folder}/raw.jsonl", "w", encoding="utf-8") as out:
    for i in range(count):
        n = i - i % 2  # an odd line repeats the even one before it
        out.write(json.dumps({"instruction": f"Question {n}: " + "why is the sky blue? " * 20,
                              "context": "", "response": f"Answer {n}: " + "because of scattering. " * 20,
                              "category": "open_qa"}) + "\\n")
tracemalloc.start()
report = clean([f"{folder}/raw.jsonl"], f"{folder}/clean", rejects=f"{folder}/rejects.jsonl")
print(json.dumps({"peak": tracemalloc.get_traced_memory()[1], "total": report["total"],
                  "torch": "torch" in sys.modules}))
"""


def traced_clean(count: int, folder) -> dict:
    folder.mkdir()
    result = subprocess.run([str(PYTHON), "-c", RUN, str(count), str(folder)], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_clean_memory_does_not_grow_with_the_records(tmp_path):
    small, large = traced_clean(RECORDS, tmp_path / "small"), traced_clean(4 * RECORDS, tmp_path / "large")
    for run, count in ((small, RECORDS), (large, 4 * RECORDS)):
        assert run["total"] == {"lines": count, "read": count, "kept": count // 2, "dropped:duplicate": count // 2}
        assert run["torch"] is False  # cleaning text has no use for torch's few hundred MB
    assert len((tmp_path / "large" / "rejects.jsonl").read_text().splitlines()) == 2 * RECORDS
    assert len((tmp_path / "large" / "clean" / "raw_clean.jsonl").read_text().splitlines()) == 2 * RECORDS
    grown = large["peak"] - small["peak"]
    assert grown < 3 * RECORDS * BYTES_PER_RECORD, (small["peak"], large["peak"])
