"""docs/benchmarks.md opens with its results table, and every row's command is one that Baton's CLIs accept: each
is parsed by the very parser that would run it (the bench or ``baton`` command, in a subprocess whose argparse stops
right after its first ``parse_args``), so a renamed or removed flag fails here. Running them is the benches' own
business (minutes to an hour each, some need a peer's venv or a trace)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.packaging import ROOT

PAGE = ROOT / "docs" / "benchmarks.md"
# Run the command's module as `python -m` would, with argparse's parse_args ending the process once it has parsed
# (exit 0) or refused (exit 2); a command that never parses exits 3.
PARSE_ONLY = """
import argparse, runpy, sys
parse = argparse.ArgumentParser.parse_args
def parse_and_stop(self, args=None, namespace=None):
    parse(self, args, namespace)
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_and_stop
module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
runpy.run_module(module, run_name="__main__", alter_sys=True)
raise SystemExit(3)
"""


def table_rows() -> list[list[str]]:
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| claim |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def commands() -> list[str]:
    found = {m.group(1) for row in table_rows() for m in [re.fullmatch(r"`([^`]+)`", row[5])] if m}
    return sorted(found)


def test_the_first_screen_is_the_results_table():
    head = PAGE.read_text().splitlines()[:40]
    assert head[0].startswith("# ") and any(line.startswith("| claim | Baton | baseline | ratio | measured | command")
                                            for line in head)
    rows = table_rows()
    assert len(rows) >= 15 and all(len(row) == 7 for row in rows), [row for row in rows if len(row) != 7]
    assert all(re.search(r"\]\(#[a-z0-9-]+\)", row[6]) for row in rows), "every row links to its section"
    headings = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$",
                PAGE.read_text(), flags=re.MULTILINE)}
    for row in rows:
        anchor = re.search(r"\]\(#([a-z0-9-]+)\)", row[6]).group(1)
        assert anchor in headings, f"{anchor} is no heading of the page"


@pytest.mark.parametrize("command", commands())
def test_every_rows_command_parses(command):
    words = shlex.split(command)
    if words[:2] == ["python", "-m"]:
        module, args = words[2], words[3:]
    elif words[0] == "baton":
        module, args = "deploy.cli", words[1:]
    else:
        pytest.fail(f"not a python -m or baton command: {command}")
    run = subprocess.run([sys.executable, "-c", PARSE_ONLY, module, *args], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert run.returncode == 0, f"{command}\n{run.stderr[-2000:]}"
