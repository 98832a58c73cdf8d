"""RELIABILITY.md stays true to the test suite: every test it cites exists, and every hardening test is cited."""

from __future__ import annotations

import re

from support.paths import REPO

RECORD = REPO / "RELIABILITY.md"


def cited_tests() -> list[tuple[str, str]]:
    return re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", RECORD.read_text(encoding="utf-8"))


def test_every_cited_test_exists():
    cited = cited_tests()
    assert len(cited) >= 50
    missing = [f"{path}::{name}" for path, name in cited
               if not (REPO / path).is_file()
               or not re.search(rf"^def {name}\(", (REPO / path).read_text(encoding="utf-8"), re.MULTILINE)]
    assert missing == []


def test_every_hardening_and_property_test_is_cited():
    cited = set(cited_tests())
    ours = [REPO / "tests" / "test_properties.py", *sorted((REPO / "tests" / "hardening").glob("test_*.py"))]
    uncited = [f"{path.relative_to(REPO)}::{name}" for path in ours
               for name in re.findall(r"^def (test_\w+)\(", path.read_text(encoding="utf-8"), re.MULTILINE)
               if (str(path.relative_to(REPO)), name) not in cited and path.name != "test_record.py"]
    assert uncited == []
