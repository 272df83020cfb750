"""Every commit a committed document names (a study's report, a benchmark's record) is in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: a run of 7 to 40 hex digits standing alone (not part of a number, a word or a path)
TOKEN = re.compile(r"(?<![\w.+\-/])[0-9a-f]{7,40}(?![\w.])")


def _git(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def commits_named(text: str) -> set[str]:
    """The commit hashes in a text: a full 40-digit hash; a short one with letters and digits
    (``e5fc525``); or any run of hex digits the word "commit" precedes (``commit 4122962``)."""
    found = set()
    for m in TOKEN.finditer(text):
        token = m.group(0)
        mixed = any(c.isdigit() for c in token) and any(c in "abcdef" for c in token)
        if len(token) == 40 or mixed or "commit" in text[max(0, m.start() - 40) : m.start()].lower():
            found.add(token)
    return found


def test_hashes_are_told_from_numbers():
    text = (
        "- Commit: `efe9dc13109c934d7bc8b8d5d096a1d2dbbb49d5`; at commit\n`4122962`, 2 cores; (37e81ac, with)\n"
        "seed `(s * 1000003 + i)`, 0.009999999776482582, 1.08e+03, /tmp/abcdef1234"
    )
    assert commits_named(text) == {"efe9dc13109c934d7bc8b8d5d096a1d2dbbb49d5", "4122962", "37e81ac"}


def test_every_commit_a_document_names_exists():
    if _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("not a git checkout")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("a shallow clone lacks the history the documents name")
    files = [f for f in _git("ls-files", "docs").stdout.split() if f.endswith((".md", ".json"))]
    assert "docs/results.md" in files
    missing = [
        f"{f}: {h}"
        for f in files
        for h in sorted(commits_named((ROOT / f).read_text()))
        if _git("cat-file", "-e", f"{h}^{{commit}}").returncode != 0
    ]
    assert not missing, f"documents name commits that are not in the repository: {missing}"
