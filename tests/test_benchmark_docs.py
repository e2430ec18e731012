"""The docs cite figures by their results folder: ``benchmarks/README.md`` stays a short guide, the
dated runs live in ``benchmarks/results/<folder>/README.md``, and no doc or comment names a run by a
label a reader cannot resolve ("session 9", "round 3", "the sixth H200 run")."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GUIDE = REPO / "benchmarks" / "README.md"
GUIDE_MAX_LINES = 250
#: The issue's check, as ``grep -rniE`` runs it (no word boundaries: "around 0" matches too).
LABEL = re.compile(rb"session [0-9]+|round [0-9]+|(first|second|third|fourth|fifth|sixth) H[12]00 run",
                   re.IGNORECASE)
LABEL_PATHS = ("docs", "musegl_core", "plugins", "README.md")
#: A results path cited anywhere in the docs or the code: ``benchmarks/results/FOLDER[/FILE]``.
CITED = re.compile(r"benchmarks/results/([A-Za-z0-9_.*-]+(?:/[A-Za-z0-9_.*-]+)*)")


def searched_files(roots=LABEL_PATHS):
    for name in roots:
        path = REPO / name
        if path.is_file():
            yield path
            continue
        for file in sorted(path.rglob("*")):
            if file.is_file() and not {"__pycache__", ".git"} & set(file.relative_to(REPO).parts):
                yield file


def label_hits(files, base: Path = REPO) -> list[str]:
    hits = []
    for file in files:
        for number, line in enumerate(file.read_bytes().splitlines(), 1):
            if LABEL.search(line):
                hits.append(f"{file.relative_to(base)}:{number}: {line.decode(errors='replace').strip()}")
    return hits


def test_the_benchmark_guide_is_short():
    assert len(GUIDE.read_text().splitlines()) <= GUIDE_MAX_LINES


def test_no_run_labels_in_docs_code_or_comments():
    assert label_hits(searched_files()) == []


def test_the_label_check_sees_what_grep_sees(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("fine\nfigures (benchmarks/README.md, Round 7)\nnorms spread around 1\n"
                   'the "Sixth H200 run"\nsession 16\nsession16 is a folder name\n')
    assert [hit.split(":")[1] for hit in label_hits([doc], base=tmp_path)] == ["2", "3", "4", "5"]


def test_every_results_folder_has_a_readme():
    folders = [path for path in RESULTS.iterdir() if path.is_dir()]
    assert folders
    assert [path.name for path in folders if not (path / "README.md").is_file()] == []


def test_cited_results_exist():
    """Every ``benchmarks/results/...`` path in the docs, the guide and the code names a folder or
    file that is there (a ``*`` matches at least one), and every folder the guide's table cites
    in backticks exists."""
    missing = []
    for file in searched_files(LABEL_PATHS + ("benchmarks",)):
        if file.suffix not in {".md", ".py", ".sh"}:
            continue
        for cited in CITED.findall(file.read_text(errors="replace")):
            cited = cited.rstrip(".")
            if not list(RESULTS.glob(cited)):
                missing.append(f"{file.relative_to(REPO)}: benchmarks/results/{cited}")
    for folder in re.findall(r"`([a-z0-9_]+_20\d\d-\d\d-\d\d[a-z0-9_]*)`", GUIDE.read_text()):
        if not (RESULTS / folder).is_dir():
            missing.append(f"benchmarks/README.md: {folder}")
    assert missing == []
