"""What the wheel is built from, read from pyproject.toml (the one list of Baton's packages and package data)."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setuptools_table() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def top_level_packages() -> tuple[str, ...]:
    """The top-level packages pyproject's ``packages.find`` includes (``"engine*"`` -> ``engine``)."""
    return tuple(pattern.rstrip("*") for pattern in setuptools_table()["packages"]["find"]["include"])


def wheel_sources() -> set[str]:
    """Every file (relative to the repo) that building the wheel reads into it: the packages' modules and their
    declared package data."""
    package_data = setuptools_table().get("package-data", {})
    files: set[str] = set()
    for top in top_level_packages():
        for path in (ROOT / top).rglob("*"):
            rel = path.relative_to(ROOT).as_posix()
            if path.is_file() and "__pycache__" not in path.parts:
                package = path.parent.relative_to(ROOT).as_posix().replace("/", ".")
                inside = path.relative_to(ROOT / top).as_posix()
                if path.suffix == ".py" or any(fnmatch.fnmatch(inside, g) for g in package_data.get(package, [])
                                               + package_data.get(top, [])):
                    files.add(rel)
    return files


def dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Whether Docker's ``.dockerignore`` ``patterns`` leave ``path`` (relative, ``/``-separated) out of the build
    context: Go's filepath.Match per pattern (``*`` within one name), ``**`` for any number of folders, a pattern
    that matches a folder leaves out all below it, ``!`` re-includes, the last matching pattern wins."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for raw in patterns:
        negate = raw.startswith("!")
        regex = _regex(raw.lstrip("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def _regex(pattern: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))
