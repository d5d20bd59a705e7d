"""``baton prefill``: run one prefill worker (the shared worker CLI, ``worker.main``, with the prefill role)."""

from __future__ import annotations

from worker.config import WorkerConfig
from worker.main import run


def main(argv: list[str]) -> int:
    return run("prefill", argv, _node)


def _node(config: WorkerConfig):
    from prefill_node.node import PrefillNode  # torch: only once the flags are good

    return PrefillNode(config)
