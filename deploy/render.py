"""``baton deploy render SPEC.yaml [-o DIR]``: a BatonGraphDeployment spec -> plain Kubernetes manifests.

Without ``-o`` one multi-document YAML stream goes to stdout (pipe it to ``kubectl apply -f -``);
with ``-o DIR`` each object is written to ``DIR/NN-kind-name.yaml`` plus a ``kustomization.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from deploy import addons
from deploy.pods import deployment
from deploy.spec import BatonGraphDeployment, SpecError, load_spec

Manifest = dict[str, Any]


def render(spec: BatonGraphDeployment) -> list[Manifest]:
    """Every object of the deployment, in apply order (config and Redis before the pods that use them)."""
    out: list[Manifest] = [addons.config_map(spec)]
    if spec.redis.external_url is None:
        out += addons.redis(spec)
    for svc in (spec.router, spec.prefill, spec.decode):
        out += [deployment(spec, svc), addons.service(spec, svc.role)]
        if svc.replicas > 0 or svc.autoscaling is not None:
            out.append(addons.disruption_budget(spec, svc))
        scaler = addons.autoscaler(spec, svc)
        if scaler is not None:
            out.append(scaler)
    if spec.service_monitor:
        out.append(addons.service_monitor(spec))
    return out


class _PlainDumper(yaml.SafeDumper):
    """Writes shared sub-objects (e.g. a Deployment's selector and pod labels) out in full, not as &anchors."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(manifests: list[Manifest]) -> str:
    return yaml.dump_all(manifests, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)


def write_dir(manifests: list[Manifest], out_dir: Path) -> list[Path]:
    """One file per object and a kustomization.yaml listing them (a kustomize base)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, manifest in enumerate(manifests):
        name = f"{index:02d}-{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"
        (out_dir / name).write_text(to_yaml([manifest]))
        paths.append(out_dir / name)
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [p.name for p in paths]}
    (out_dir / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton deploy render",
                                     description="Render a BatonGraphDeployment spec to Kubernetes manifests.")
    parser.add_argument("spec", type=Path, help="the spec YAML (see deploy/examples/)")
    parser.add_argument("-o", "--output-dir", type=Path, default=None,
                        help="write one file per object and a kustomization.yaml here (default: YAML to stdout)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        manifests = render(load_spec(args.spec))
    except SpecError as exc:
        print(f"baton deploy render: {args.spec}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"baton deploy render: {exc}", file=sys.stderr)
        return 1
    if args.output_dir is None:
        sys.stdout.write(to_yaml(manifests))
    else:
        paths = write_dir(manifests, args.output_dir)
        print(f"wrote {len(paths)} manifests and kustomization.yaml to {args.output_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
