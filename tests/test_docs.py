"""The project's docs stand alone: every relative link resolves inside the repository, and no
doc or module cites a design file that lives outside it."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench/RESULTS.md"]


def test_relative_links_in_docs_resolve_inside_the_repo() -> None:
    broken = []
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # a web address
            path = (doc.parent / target).resolve()
            if not path.is_relative_to(REPO) or not path.exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert broken == []


def test_nothing_cites_a_design_file_outside_the_repo() -> None:
    sources = [
        *DOCS,
        *REPO.glob("operator/phasefleet/**/*.py"),
        *REPO.glob("runtime_image/phasefleet/**/*.py"),
        *REPO.glob("helm/phasefleet/templates/*"),
    ]
    citing = [str(p.relative_to(REPO)) for p in sources if "DESIGN" in p.read_text()]
    assert citing == []


def test_architecture_page_is_linked_from_the_readme() -> None:
    assert "docs/architecture.md" in (REPO / "README.md").read_text()
