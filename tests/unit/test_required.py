"""``BATON_TEST_REQUIRE`` (tests/required.py): in a run that requires something, a test that lacks it fails with
the reason instead of skipping; in any other run it skips as before."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.packaging import ROOT

MISSING_MODULE = '''
from tests.required import import_or_skip

import_or_skip("baton_no_such_module", "mooncake", "the store tier needs mooncake-transfer-engine-non-cuda")


def test_never_runs():
    pass
'''


def pytest_run(tmp_path, require: str | None) -> subprocess.CompletedProcess:
    (tmp_path / "test_lacking.py").write_text(MISSING_MODULE)
    env = {k: v for k, v in os.environ.items() if k != "BATON_TEST_REQUIRE"}
    if require is not None:
        env["BATON_TEST_REQUIRE"] = require
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
                           str(tmp_path / "test_lacking.py"), "--rootdir", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_a_missing_requirement_skips_in_an_ordinary_run(tmp_path):
    run = pytest_run(tmp_path, None)
    assert run.returncode in (0, 5) and "1 skipped" in run.stdout, run.stdout + run.stderr  # 5: none ran


def test_a_missing_requirement_fails_a_run_that_requires_it(tmp_path):
    run = pytest_run(tmp_path, "root,mooncake")
    assert run.returncode != 0 and "BATON_TEST_REQUIRE names mooncake" in run.stdout, run.stdout + run.stderr


def test_another_requirement_does_not_turn_the_skip_into_a_failure(tmp_path):
    run = pytest_run(tmp_path, "root")
    assert run.returncode in (0, 5) and "1 skipped" in run.stdout, run.stdout + run.stderr  # 5: none ran
