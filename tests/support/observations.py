"""What the architecture matrix's checks observed, held to docs/models.json, from which scripts/models_table.py
renders the README's table. tests/test_matrix.py observes every cell but GGUF export, which tests/test_gguf.py
observes (every type, each family with the kind of tokenizer its released models have).

Each test module writes its observations to a file of its own under .cache/matrix/ (under pytest-xdist the two
modules may run in different processes); `python scripts/models_table.py --update` takes them into docs/models.json
and renders the table again, so a change that breaks or fixes a cell updates the table."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable

from support.families import FAMILIES
from support.paths import CACHE, REPO

from gpt4all_training.errors import UserError

COMMITTED = REPO / "docs" / "models.json"
# tests/test_gguf.py's families, by the matrix's names (support/families.py): the rows whose GGUF cell it observes.
GGUF_FAMILIES = {"llama3": "llama3", "smollm2": "smollm2", "mistral": "mistral", "qwen2": "qwen2.5", "qwen3": "qwen3",
                 "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "smollm3": "smollm3", "gpt_neox": "pythia"}
OBSERVED = CACHE / "matrix"


def table_script():
    """scripts/models_table.py, which renders the README's table from docs/models.json."""
    spec = importlib.util.spec_from_file_location("models_table", REPO / "scripts" / "models_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def forget(source: str) -> None:
    """Start `source`'s observations afresh (a module fixture of each observing module calls it)."""
    (OBSERVED / f"{source}.json").unlink(missing_ok=True)


def observe(source: str, family: str, cell: str, check: Callable[[], object]) -> None:
    """Run a cell's check: "passes", or "refused: " and the one line a UserError refused it with. Recorded in
    OBSERVED/<source>.json, and it must be what docs/models.json says. A failed assertion fails the test and records
    nothing."""
    try:
        check()
        outcome = "passes"
    except UserError as error:
        outcome = f"refused: {error}"
    path = OBSERVED / f"{source}.json"
    results = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"families": {}}
    name, features = FAMILIES[family]
    entry = results["families"].setdefault(family, {"cells": {}})
    entry.update(name=name, features=features)
    entry["cells"][cell] = outcome
    OBSERVED.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    committed = json.loads(COMMITTED.read_text(encoding="utf-8"))["families"][family]["cells"][cell]
    assert outcome == committed, "if the change is meant: python scripts/models_table.py --update"
