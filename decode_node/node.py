"""A decode worker: the shared worker shell with the ``Decode`` servicer."""

from __future__ import annotations

from decode_node.first_tokens import FirstTokenMailbox
from decode_node.servicer import DecodeServicer
from prefill_node.node import WorkerConfig, WorkerNode


class DecodeNode(WorkerNode):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.first_tokens = FirstTokenMailbox()  # layer-wise Decodes wait here for P's first token

    def servicer(self) -> DecodeServicer:
        return DecodeServicer(self)
