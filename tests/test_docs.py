"""The docs against the code: the README's flag table names real flags with their real defaults,
its first commands are what CI runs, every relative link resolves, the results table keeps one
figure per cell with its commit, date and run, and the files the architecture names exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from radixserve.launch_server import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


def table_rows(text: str, header_start: str) -> list[list[str]]:
    """The body rows of the first markdown table whose header line starts with header_start."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def test_readme_flag_table_names_real_flags_with_their_defaults():
    actions = {opt: a for a in build_parser()._actions for opt in a.option_strings}
    rows = table_rows((ROOT / "README.md").read_text(), "| flag | what it does | default |")
    assert len(rows) >= 12
    for flag_cell, _, default_cell in rows:
        flags = re.findall(r"`(--[a-z0-9-]+)`", flag_cell)
        defaults = [d.strip() for d in default_cell.split(" / ")]
        assert flags and len(defaults) in (1, len(flags)), flag_cell
        for flag, default in zip(flags, defaults * len(flags) if len(defaults) == 1 else defaults):
            assert flag in actions, f"{flag} is not a flag of launch_server"
            value = actions[flag].default
            if value is None or value is False:
                continue  # the default is described in words (the model's, off, none)
            written = default.replace("`", "").replace(",", "")
            spelled = f"{value:g}" if isinstance(value, float) else str(value)
            assert re.match(rf"{re.escape(spelled)}\b", written), \
                f"README says {flag} defaults to {default}; the parser says {value!r}"


def test_readme_first_commands_are_what_ci_runs():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in readme
    setup = "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]'"
    assert f"{setup} && python -m radixserve.experiment" in readme


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.relative_to(ROOT)} links to {target}, which does not exist"


def test_results_table_rows_are_complete():
    header = ("| workload | metric | radixserve | best peer | floor | ours / peer | ours / floor | device | commit "
              "| date | how | run |")
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    assert header in text
    rows = table_rows(text, header)
    assert rows
    commands = set(re.findall(r"^- \*\*([a-z0-9-]+)\*\*", text, re.M))
    for row in rows:
        assert len(row) == 12, row
        assert re.fullmatch(r"[0-9a-f]{7,40}", row[8]), f"commit of {row[0]}: {row[8]}"
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[9]), f"date of {row[0]}: {row[9]}"
        assert row[10] in commands, f"{row[0]}: no command named {row[10]!r} under How to reproduce"
        link = re.fullmatch(r"\[[^]]+\]\((runs/\d{4}-\d{2}-\d{2}-[a-z0-9.-]+\.md)\)", row[11])
        assert link and (ROOT / "docs" / link.group(1)).exists(), f"run of {row[0]}: {row[11]}"


def test_architecture_names_files_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    package = ROOT / "radixserve"
    names = {p.name for p in package.rglob("*.py")}
    for path in set(re.findall(r"`([a-z_/]+\.py)`", text)):
        if "/" in path:
            assert (package / path).exists() or (ROOT / path).exists(), path
        else:
            assert path in names, path


def heading_anchors(doc: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings (code blocks left out)."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_anchor_links_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        path, anchor = target.split("#", 1)
        linked = (doc.parent / path).resolve() if path else doc
        if linked.suffix == ".md" and linked.exists():
            assert anchor in heading_anchors(linked), f"{doc.relative_to(ROOT)} links to {target}: no such heading"


def test_tuning_guide_names_real_flags_with_their_defaults():
    """Every flag the guide names is the server's (or the scheduler simulator's, for its one
    command), and every `--flag ...` (default V) it writes matches the parser's default."""
    import dataclasses

    from radixserve.bench.scheduler_sim import SimConfig

    actions = {opt: a for a in build_parser()._actions for opt in a.option_strings}
    simulator = {"--hybrid-27b", "--policies", *("--" + f.name.replace("_", "-") for f in dataclasses.fields(SimConfig))}
    text = (ROOT / "docs" / "tuning.md").read_text()
    for flag in set(re.findall(r"(--[a-z0-9][a-z0-9-]+)", text)):
        assert flag in actions or flag in simulator, f"docs/tuning.md names {flag}, which is no flag"
    checked = 0
    for flag, default in re.findall(r"`(--[a-z0-9-]+)(?: [^`]*)?` \(default ([^;)]+?)(?:[;)]|, |:)", text):
        value = actions[flag].default
        if value is None or value is False:
            continue  # described in words
        written = default.replace("`", "").replace(",", "").strip()
        spelled = f"{value:g}" if isinstance(value, float) else str(value)
        assert re.match(rf"{re.escape(spelled)}\b", written), \
            f"docs/tuning.md says {flag} defaults to {default}; the parser says {value!r}"
        checked += 1
    assert checked >= 15
