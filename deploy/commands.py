"""``baton deploy <command>``: ``render`` a BatonGraphDeployment spec to manifests, print the ``crd``, or run
the ``operator`` that reconciles the resources in a cluster."""

from __future__ import annotations

import sys
from pathlib import Path

CRD_PATH = Path(__file__).with_name("crd.yaml")
_USAGE = """usage: baton deploy <command> [options]

commands:
  render    render a BatonGraphDeployment spec to Kubernetes manifests (baton deploy render SPEC.yaml [-o DIR])
  crd       print the BatonGraphDeployment CustomResourceDefinition (kubectl apply -f -)
  operator  reconcile BatonGraphDeployment resources into Kubernetes objects
            (baton deploy operator [--namespace NS] [--once] [--interval-s S] [--print-rbac])"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_USAGE)
        return 0
    if argv[0] == "render":
        from deploy.render import main as render_main

        return render_main(argv[1:])
    if argv[0] == "operator":
        from deploy.operator import main as operator_main

        return operator_main(argv[1:])
    if argv[0] == "crd":
        sys.stdout.write(CRD_PATH.read_text())
        return 0
    print(f"baton deploy: unknown command {argv[0]!r}\n\n{_USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
