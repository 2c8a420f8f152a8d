"""A fresh clone is self-contained: nothing reads data from outside the repository, and every data file
that the tests and notebooks open is in it (tests/data, examples/data)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS, DATA = ROOT / "tests", ROOT / "tests" / "data"
CHECKED = ("kvrag", "tests", "notebooks", "examples", "scripts")
SKIPPED_DIRS = {"__pycache__", ".ipynb_checkpoints", ".hypothesis", ".pytest_cache"}

# Assembled from pieces, so that this file does not match them itself.
OUTSIDE = "shared"
FORBIDDEN = [b"../" + OUTSIDE.encode(), OUTSIDE.encode() + b"/data", OUTSIDE.encode() + b"\\data"]
PATH_JOIN = re.compile(rb"""["']""" + OUTSIDE.encode() + rb"""["']\s*/""")  # Path(...) / "<that folder>"


def repo_files() -> list[Path]:
    """The repository's files under CHECKED: tracked and new ones (git), or all of them outside a checkout."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z", "--", *CHECKED], cwd=ROOT,
                             capture_output=True, check=True).stdout
        files = [ROOT / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):  # an exported copy, without .git
        files = [p for d in CHECKED for p in (ROOT / d).rglob("*")
                 if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)]
    return [p for p in files if p.is_file()]


def test_nothing_reads_data_from_outside_the_repository():
    files = repo_files()
    assert any(p.name == "conftest.py" for p in files) and any(p.suffix == ".ipynb" for p in files)
    offenders = []
    for path in files:
        data = path.read_bytes()
        if any(s in data for s in FORBIDDEN) or PATH_JOIN.search(data):
            offenders.append(str(path.relative_to(ROOT)))
    assert offenders == [], f"these files point outside the repository: {offenders}"


# -- the data files the tests and notebooks open --------------------------------------------------------

# in the tests: conftest's DATA, or a folder named data, joined with quoted parts (Path's "/")
TEST_PATH = re.compile(r"""(?:\bDATA|["']data["'])((?:\s*/\s*["'][^"'\n]+["'])+)""")
# in the notebooks, which run in notebooks/: Path(...) of a quoted path starting with ../
NOTEBOOK_PATH = re.compile(r"""Path\(\\?["'](\.\./[^"'\\]+)\\?["']\)""")
EXPECTED = {  # what the scans must find, at least: guards the patterns themselves
    "tests/data/qa/hotpotqa_ircot.jsonl", "tests/data/qa/musique_cacheblend_dev75.jsonl",
    "tests/data/corpus/2wikimultihopqa_corpus.json", "tests/data/nltk_data", "examples/data/hotpotqa_ircot.jsonl",
}


def opened_paths() -> set[str]:
    found = set()
    for test in TESTS.glob("*.py"):
        for chain in TEST_PATH.findall(test.read_text(encoding="utf-8")):
            parts = re.findall(r"""["']([^"']+)["']""", chain)
            found.add((DATA.joinpath(*parts)).relative_to(ROOT).as_posix())
    for book in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(book.read_text(encoding="utf-8"))["cells"]
        source = "".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        for rel in NOTEBOOK_PATH.findall(source):
            found.add((ROOT / "notebooks" / rel).resolve().relative_to(ROOT).as_posix())
    return found


def test_every_data_file_the_tests_and_notebooks_open_is_in_the_repository():
    opened = opened_paths()
    assert EXPECTED <= opened, f"not found by the scan: {EXPECTED - opened}"
    missing = [p for p in sorted(opened) if not (ROOT / p).exists()]
    assert missing == []
    for rel in opened:
        path = ROOT / rel
        assert path.is_dir() or path.stat().st_size > 0, rel


def test_qa_files_hold_the_items_the_tests_use():
    for rel, n in [("tests/data/qa/hotpotqa_ircot.jsonl", 3), ("tests/data/qa/musique_cacheblend_dev75.jsonl", 4),
                   ("examples/data/hotpotqa_ircot.jsonl", 2)]:
        rows = [json.loads(line) for line in (ROOT / rel).read_text(encoding="utf-8").splitlines()]
        assert len(rows) >= n, rel
        for row in rows:
            assert {"id", "question", "answers", "ctxs"} <= row.keys() and row["ctxs"], rel
    corpus = json.loads((DATA / "corpus" / "2wikimultihopqa_corpus.json").read_text(encoding="utf-8"))
    assert len("\n\n".join(f"{p['title']}\n{p['text']}" for p in corpus)) >= 200_000  # test_split's 200 KB


def test_punkt_tab_english_is_complete():
    english = DATA / "nltk_data" / "tokenizers" / "punkt_tab" / "english"
    names = {"abbrev_types.txt", "collocations.tab", "ortho_context.tab", "sent_starters.txt"}
    assert names <= {p.name for p in english.iterdir()}


def test_test_data_is_small_and_described():
    files = [p for p in DATA.rglob("*") if p.is_file() and p.name != "README.md"]
    assert sum(p.stat().st_size for p in files) < 2_000_000
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    for path in files:
        rel = path.relative_to(DATA).as_posix()
        assert rel in readme or path.parent.relative_to(DATA).as_posix() + "/" in readme, f"{rel} not in README"
    assert "licence" in readme.lower()


def test_example_data_is_described():
    readme = (ROOT / "examples" / "data" / "README.md").read_text(encoding="utf-8")
    assert "hotpotqa_ircot.jsonl" in readme and "Licence" in readme
