"""The README and docs/ hold together: relative links and their anchors resolve, docs/README.md
lists every page, README examples use only public names, and the README's first code block
after the quick start is the one-line protection that docs/protect.md's test runs."""

from __future__ import annotations

import re
from pathlib import Path

from mscale.rules.render import anchor
from support import REPO

DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def headings(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {anchor(m.group(1).strip()) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_relative_links_and_anchors_resolve() -> None:
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto
            file, _, frag = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif frag and dest.suffix == ".md" and frag not in headings(dest):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_docs_index_lists_every_page() -> None:
    index = (DOCS / "README.md").read_text()
    listed = {t.partition("#")[0] for t in LINK.findall(index)}
    missing = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md" and p.name not in listed)
    assert not missing, f"docs/README.md does not list: {missing}"


def test_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    missing = sorted(p.name for p in DOCS.glob("*.md") if f"docs/{p.name}" not in readme)
    assert not missing, f"the README does not link: {missing}"


def test_readme_examples_use_public_names_only() -> None:
    import mscale

    blocks = [code for lang, code in FENCE.findall((REPO / "README.md").read_text()) if lang == "python"]
    assert blocks
    public = "|".join(mscale._SUBMODULES)  # the integrations' faces: mscale.accelerate.attach, ...
    internal = [
        line
        for code in blocks
        for line in code.splitlines()
        if re.search(rf"\bfrom mscale\.|\bimport mscale\.|\bmscale\.(?!(?:{public})\.)[a-z_]+\.", line)
    ]
    assert not internal, f"README examples reach into internal modules: {internal}"


def test_first_block_after_quick_start_is_the_one_line_protection() -> None:
    readme = (REPO / "README.md").read_text()
    quick_start = readme.index("\n## Quick start")
    after = readme[readme.index("\n## ", quick_start + 1) :]  # from the next section on
    lang, code = FENCE.search(after).groups()
    protect = [c for lg, c in FENCE.findall((DOCS / "protect.md").read_text()) if lg == "python"]
    assert lang == "python" and protect, "no python block"
    assert code == protect[0], "the README's first block after Quick start is not docs/protect.md's first block"
    assert "mscale.attach(" in code
