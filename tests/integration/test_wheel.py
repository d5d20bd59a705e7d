"""Baton as a user installs it: the wheel built from this tree (as an image build sees it: less .dockerignore), installed (not editable) into a fresh virtual
environment outside the repository, run from another folder. ``baton deploy crd`` and ``baton deploy render`` of
an example shipped in the wheel read its package data; ``baton up --model tiny`` builds the tiny checkpoint,
starts Redis, the router and a prefill and a decode worker from the installed packages only, and answers one
request. (Dropping a package from pyproject.toml's list fails here: ``baton up`` cannot start that part.)

The fresh environment borrows the third-party dependencies of the test's own environment through a ``.pth`` line
naming its site-packages (torch and the rest are hundreds of MB; a plain path line does not run that folder's own
``.pth`` files, so the repo's editable install stays out of sight)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.integration.cluster import ROOT, free_port, interrupt
from tests.integration.test_scaling import decode_workers, generate, prefill_workers, wait_for
from tests.packaging import dockerignore_excludes, top_level_packages
from tests.redis_server import require_redis_server

PURELIB = Path(sysconfig.get_paths()["purelib"])


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The fresh environment's ``bin`` folder, the wheel installed in it."""
    work = tmp_path_factory.mktemp("wheel")
    context = work / "context"  # what an image build gets: the tree less .dockerignore (no stale build/ folder)
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    shutil.copytree(ROOT, context, ignore=lambda folder, names: [
        name for name in names if dockerignore_excludes(patterns, (Path(folder) / name).relative_to(ROOT).as_posix())])
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(work / "dist"), str(context)], check=True, cwd=work)
    wheel = next((work / "dist").glob("baton-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"{top}/__init__.py" for top in top_level_packages()} <= names
    assert {"deploy/crd.yaml", "deploy/grafana/baton-dashboard.json", "deploy/prometheus/alerts.yaml",
            "deploy/examples/single-node.yaml", "proto/baton.proto"} <= names
    venv = work / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, cwd=work)
    site = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "zz-borrowed-dependencies.pth").write_text(f"{PURELIB}\n")
    return venv / "bin"


def run(bin_dir: Path, *args: str, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(bin_dir / "baton"), *args], check=True, capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=120).stdout


def test_the_installed_packages_are_the_wheels(installed, tmp_path):
    where = subprocess.check_output([installed / "python", "-c", "import deploy, worker, engine; "
                                     "print(deploy.__file__, worker.__file__, engine.__file__)"],
                                    text=True, cwd=tmp_path).split()
    assert all(not Path(p).is_relative_to(ROOT) and Path(p).is_relative_to(installed.parent) for p in where), where


def test_deploy_reads_its_package_data(installed, tmp_path):
    assert "BatonGraphDeployment" in run(installed, "deploy", "crd", cwd=tmp_path)
    example = subprocess.check_output([installed / "python", "-c", "import deploy, pathlib; print(pathlib.Path("
                                       "deploy.__file__).with_name('examples') / 'single-node.yaml')"],
                                      text=True, cwd=tmp_path).strip()
    manifests = run(installed, "deploy", "render", example, "-o", str(tmp_path / "out"), cwd=tmp_path)
    rendered = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "kustomization.yaml" in rendered and any("deployment" in name for name in rendered), (manifests, rendered)


def test_baton_up_from_the_wheel_answers_a_request(installed, tmp_path):
    require_redis_server()
    port, log_dir = free_port(), tmp_path / "logs"
    log_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(BATON_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    cmd = [str(installed / "baton"), "up", "--model", "tiny", "--port", str(port), "--metrics-port", "0",
           "--http-port", "0", "--log-dir", str(log_dir), "--calibrate-tokens", "0"]
    with (log_dir / "up.out").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env)
    address = f"127.0.0.1:{port}"
    try:
        wait_for(lambda: _serving(address), 180, proc, log_dir)
        final = generate(address, [5, 6, 7, 8, 9, 10])
        assert final.usage.completion_tokens == 4, final
    finally:
        interrupt(proc)
    assert proc.returncode == 0, (log_dir / "up.out").read_text()[-3000:]


def _serving(address: str) -> bool:
    try:
        return prefill_workers(address) == ["prefill-0"] and decode_workers(address) == ["decode-0"]
    except Exception:  # noqa: BLE001 - not up yet
        return False
