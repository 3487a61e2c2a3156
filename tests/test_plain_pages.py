"""The pages a new user reads first (the README, the getting-started page) read well as plain Markdown on the
repository host too: no site-only tab or include markup, and the figures they show are generated from the published
reports, never typed."""

from __future__ import annotations

import re
from pathlib import Path

from test_docs import load_script

REPO = Path(__file__).resolve().parents[1]


def test_plain_pages_hold_no_site_only_markup():
    gen = load_script(REPO / "docs" / "gen_results.py")
    assert REPO / "docs" / "getting-started.md" in gen.PLAIN_PAGES
    for page in (*gen.PLAIN_PAGES, REPO / "README.md"):
        text = page.read_text()
        assert not re.search(r'^=== "', text, re.MULTILINE), f'{page.name}: a tab (=== "...") shows as raw text'
        assert "--8<--" not in text, f"{page.name}: a snippet include shows as a raw line"


def test_the_study_blocks_of_plain_pages_are_the_published_reports(tmp_path):
    gen = load_script(REPO / "docs" / "gen_results.py")
    page = (REPO / "docs" / "getting-started.md").read_text()
    assert gen.page_with_study_blocks(page) == page, "docs/getting-started.md is stale: run python docs/gen_results.py"
    table = gen.snippet((gen.PUBLISHED / "default" / "report.md").read_text(), "table")
    assert table.splitlines()[3] in page  # the default study's first measured row, as its report has it
    stale = page.replace(table.splitlines()[3], "| FedSimCLR | 0 | 99.00 |")
    assert gen.page_with_study_blocks(stale) == page  # a hand edit inside the block is rewritten
