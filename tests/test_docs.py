"""The README is a front door: short, linking every page under docs/, and together with docs/ it documents every
make target and every `tim` command; no relative link in them points at nothing."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in [README, *PAGES, *sorted((ROOT / "docs").rglob("*/*.md"))])


def make_targets() -> list[str]:
    phony = re.search(r"^\.PHONY:(.*)$", (ROOT / "Makefile").read_text(), re.M)
    return phony.group(1).split()


def tim_commands() -> list[str]:
    from tim_megatron.cli import app

    out = [c.name for c in app.registered_commands if not c.hidden]
    for group in app.registered_groups:
        out += [f"{group.name} {c.name}" for c in group.typer_instance.registered_commands if not c.hidden]
    return out


def test_every_make_target_and_tim_command_appears_in_the_docs():
    text = _docs_text()
    targets, commands = make_targets(), tim_commands()
    assert len(targets) >= 18 and "gpu-check" in targets and len(commands) >= 17 and "lab" in commands
    missing = [f"make {t}" for t in targets if f"make {t}" not in text]
    missing += [f"tim {c}" for c in commands if f"tim {c}" not in text]
    assert not missing, f"not in README.md or docs/: {missing}"


def test_the_readme_is_short_and_links_every_docs_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    linked = {(README.parent / m).resolve() for m in LINK.findall(text)}
    assert PAGES and not [p.name for p in PAGES if p.resolve() not in linked]


def test_no_relative_link_in_the_readme_or_docs_points_at_nothing():
    broken = []
    for page in [README, *PAGES, *sorted((ROOT / "docs").rglob("*/*.md"))]:
        for target in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken
