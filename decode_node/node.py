"""A decode worker: the shared worker shell with the ``Decode`` servicer."""

from __future__ import annotations

from decode_node.servicer import DecodeServicer
from prefill_node.node import WorkerNode


class DecodeNode(WorkerNode):
    def servicer(self) -> DecodeServicer:
        return DecodeServicer(self)
