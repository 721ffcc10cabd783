"""The README and docs/ hold together: relative links and their anchors resolve, docs/README.md
lists every page, README examples use only public names, and the README's first code block
after the quick start is the one-line protection that docs/protect.md's test runs. The README
stays a short front page (under 250 lines) that still holds the two commands, the metric and
alert lists (complete, checked against docs/metrics.md and the rules) and the main
configuration keys (each a real key with its real default)."""

from __future__ import annotations

import re
from pathlib import Path

from mscale.rules.alerts import ALERTS
from mscale.rules.render import anchor
from support import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
README_MAX_LINES = 250
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


def section(text: str, begin: str, end: str) -> str:
    """The text between the line starting with `begin` and the one starting with `end`."""
    start = text.index(begin)
    return text[text.index("\n", start) : text.index(end, start)]


def test_readme_is_a_short_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) < README_MAX_LINES, (
        f"README.md has {len(lines)} lines: move detail to docs/ (< {README_MAX_LINES})"
    )


def test_readme_keeps_the_two_commands_and_its_sections() -> None:
    readme = README.read_text()
    quick = section(readme, "## Quick start", "\n## ")
    lang, code = FENCE.search(quick).groups()
    commands = [line.split("#")[0].strip() for line in code.splitlines()]
    assert lang == "sh" and commands == ["make demo", "make test"], commands
    assert "make test" in (REPO / ".ci" / "run").read_text()  # CI runs the README's test command
    wanted = [
        "Quick start",
        "Protect your training loop",
        "What it costs",
        "What happens on each fault",
        "The fuse",
        "Configuration",
        "Metrics",
        "Alerts",
        "The fault campaign",
        "Where the docs are",
    ]
    have = set(re.findall(r"^#{2,3} (.+)$", FENCE.sub("", readme), re.M))
    assert not [h for h in wanted if h not in have], f"README sections missing: {[h for h in wanted if h not in have]}"
    fuse = section(readme, "### The fuse", "\n## ")
    assert all(f"**{level}" in fuse for level in ("L1 swap", "L2 degrade", "L3 distil"))


def test_readme_docs_links_resolve() -> None:
    readme = FENCE.sub("", README.read_text())
    links = [t for t in LINK.findall(readme) if t.startswith("docs/")]
    assert links
    broken = []
    for target in links:
        file, _, frag = target.partition("#")
        dest = REPO / file
        if not dest.is_file():
            broken.append(f"{target} (no such file)")
        elif frag and frag not in headings(dest):
            broken.append(f"{target} (no such heading)")
    assert not broken, "README links that do not resolve:\n" + "\n".join(broken)


def documented_metrics() -> list[str]:
    """The metric names of docs/metrics.md's table (tests/test_metrics_doc.py holds it to a live scrape)."""
    body = section((DOCS / "metrics.md").read_text(), "<!-- metrics-table:begin", "<!-- metrics-table:end")
    return [m for m in re.findall(r"^\|\s*`([a-zA-Z_:][a-zA-Z0-9_:]*)`\s*\|", body, re.M)]


def test_readme_lists_every_metric_and_no_other() -> None:
    listed = re.findall(
        r"`([a-z_:][a-z0-9_:]*)`", section(README.read_text(), "<!-- metrics-list:begin", "<!-- metrics-list:end")
    )
    documented = documented_metrics()
    assert len(documented) > 100 and len(set(listed)) == len(listed), "a metric listed twice in the README"
    missing, extra = sorted(set(documented) - set(listed)), sorted(set(listed) - set(documented))
    assert not missing and not extra, f"README metric list: missing {missing}, not in docs/metrics.md {extra}"


def test_readme_lists_every_alert_and_no_other() -> None:
    listed = re.findall(r"`(\w+)`", section(README.read_text(), "<!-- alerts-list:begin", "<!-- alerts-list:end"))
    rules = [a.name for a in ALERTS]
    assert rules and len(set(listed)) == len(listed), "an alert listed twice in the README"
    missing, extra = sorted(set(rules) - set(listed)), sorted(set(listed) - set(rules))
    assert not missing and not extra, f"README alert list: missing {missing}, not an alert {extra}"


def test_readme_configuration_keys_are_real_with_their_defaults() -> None:
    reference = dict(re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", (DOCS / "configuration.md").read_text(), re.M))
    table = section(README.read_text(), "## Configuration", "\n## ")
    rows = re.findall(r"^\| `([a-z_.]+)` \| `([^`]*)` \|", table, re.M)
    assert len(rows) >= 10 and len(reference) > 100
    wrong = [
        f"{k} = {d} (docs/configuration.md: {reference.get(k, 'no such key')})"
        for k, d in rows
        if reference.get(k) != d
    ]
    assert not wrong, "README configuration table disagrees with docs/configuration.md:\n" + "\n".join(wrong)
