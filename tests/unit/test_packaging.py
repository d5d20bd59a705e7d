"""The installable product, read without building anything: every package folder is in pyproject.toml's one list,
every file the wheel is built from reaches both container images' build (COPY, less .dockerignore) before the
image installs the project, and the files read at run time are declared package data. (``tests/integration/
test_wheel.py`` builds the wheel, installs it outside the repo and runs it.)"""

from __future__ import annotations

import pytest

from tests.packaging import ROOT, dockerignore_excludes, top_level_packages, wheel_sources

DOCKERFILES = ("deploy/docker/Dockerfile", "deploy/docker/Dockerfile.cpu")
READ_AT_RUN_TIME = ("deploy/crd.yaml", "deploy/grafana/baton-dashboard.json", "deploy/prometheus/alerts.yaml",
                    "deploy/examples/single-node.yaml", "proto/baton.proto")


def test_every_package_folder_is_in_the_one_list():
    on_disk = {d.name for d in ROOT.iterdir() if (d / "__init__.py").is_file() and d.name != "tests"}
    assert set(top_level_packages()) == on_disk
    for top in top_level_packages():  # packages.find skips a folder without __init__.py, and all below it
        folders = {p.parent for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
        assert all((folder / "__init__.py").is_file() for folder in folders), sorted(map(str, folders))


def test_files_read_at_run_time_are_package_data():
    assert set(READ_AT_RUN_TIME) <= wheel_sources()


def copied_sources(dockerfile: str) -> tuple[list[str], int]:
    """The sources of the build stage's COPY instructions (not ``--from``) before the line that installs the project,
    and that line's number."""
    sources, lines = [], (ROOT / dockerfile).read_text().splitlines()
    for number, line in enumerate(lines):
        words = [] if line.lstrip().startswith("#") else [w.strip("'\"") for w in line.split()]
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources += [w for w in words[1:-1] if not w.startswith("--")]
        if words[:1] == ["RUN"] and "pip install" in line and "." in [w.split("[")[0] for w in words]:
            return sources, number
    raise AssertionError(f"{dockerfile} never installs the project (pip install .)")


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_the_images_build_from_every_file_the_wheel_needs(dockerfile):
    sources, _ = copied_sources(dockerfile)
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    needed = wheel_sources() | {"pyproject.toml", "README.md"}
    in_context = {path for path in needed if not dockerignore_excludes(patterns, path)}
    roots = [source.rstrip("/").removeprefix("./") for source in sources]
    copied = {path for path in in_context if any(r in (".", "") or path == r or path.startswith(r + "/")
                                                 for r in roots)}
    missing = needed - copied
    assert not missing, f"{dockerfile} builds without {len(missing)} files of {sorted({p.split('/')[0] for p in missing})}"


def test_the_dockerignore_reading_follows_docker():
    patterns = ["**/__pycache__", "bench/results", ".venv-*", "*.log", "docs", "!docs/keep.md"]
    assert dockerignore_excludes(patterns, "engine/__pycache__/x.pyc")
    assert dockerignore_excludes(patterns, "__pycache__/x.pyc")
    assert dockerignore_excludes(patterns, "bench/results/a.json") and not dockerignore_excludes(patterns, "bench/x.py")
    assert dockerignore_excludes(patterns, ".venv-vllm/bin/python") and not dockerignore_excludes(patterns, ".venv")
    assert dockerignore_excludes(patterns, "a.log") and not dockerignore_excludes(patterns, "deploy/a.log")
    assert dockerignore_excludes(patterns, "docs/a.md") and not dockerignore_excludes(patterns, "docs/keep.md")
