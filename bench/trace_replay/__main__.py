"""``python -m bench.trace_replay``: the same as ``python -m bench trace``."""

from bench.trace_replay.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
