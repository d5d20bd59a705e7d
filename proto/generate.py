"""Regenerate the committed protobuf / gRPC modules: ``python -m proto.generate [--out DIR]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ["proto/baton.proto"]


def generate(out_dir: Path) -> None:
    from grpc_tools import protoc  # a test/dev dependency (grpcio-tools), not needed at run time

    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = ["protoc", f"-I{ROOT}", f"-I{include}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}",
            f"--pyi_out={out_dir}", *[str(ROOT / p) for p in PROTOS]]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repository)")
    generate(parser.parse_args(argv).out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
