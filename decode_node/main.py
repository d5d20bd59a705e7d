"""``baton decode``: run one decode worker (the shared worker CLI, ``worker.main``, with the decode role)."""

from __future__ import annotations

from worker.config import WorkerConfig
from worker.main import run


def main(argv: list[str]) -> int:
    return run("decode", argv, _node)


def _node(config: WorkerConfig):
    from decode_node.node import DecodeNode  # torch: only once the flags are good

    return DecodeNode(config)
