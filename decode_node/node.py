"""A decode worker: the worker shell that imports prompts' KV from prefill workers (or prefills them itself)
and decodes them in its continuous batch (``decode_node/servicer.py``)."""

from __future__ import annotations

from decode_node.first_tokens import FirstTokenMailbox
from decode_node.servicer import DecodeServicer
from worker.config import WorkerConfig
from worker.node import WorkerNode


class DecodeNode(WorkerNode):
    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.first_tokens = FirstTokenMailbox()  # layer-wise Decodes wait here for P's first token

    def servicer(self) -> DecodeServicer:
        return DecodeServicer(self)
