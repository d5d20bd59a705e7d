"""Workers that share compute: several modelled workers on one host's ``cores`` (the calibration machine's CPU).

A GPU worker has its device to itself, and the simulator needs none of this for one. On the machine the
simulator is calibrated on (``baton simulate check``), every worker is a process with one torch thread and they
all share 2 CPU cores: a profiled curve is a worker alone, and a step that runs while other workers compute takes
longer. Processor sharing: a step that starts while ``k`` other workers on its host are in a step of theirs runs
``max(1, (k + 1 + background) / cores)`` times as long as alone, ``background`` being the runnable processes the
simulator does not model (other programs on a shared machine: the load average before a real run). The factor is
read once, when the step (or a decode segment) is planned: steps are short next to the changes of the load. Pure.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sim.timing import Chunk, TimeModel


class SharedCores:
    def __init__(self, cores: int, host: dict[str, int], busy: Callable[[str], bool], *,
                 background: float = 0.0) -> None:
        if cores < 1 or background < 0:
            raise ValueError(f"cores must be >= 1 and background >= 0, got {cores}, {background}")
        self.cores, self.background, self._busy = cores, background, busy
        self._peers = {w: [v for v in host if host[v] == h and v != w] for w, h in host.items()}
        self._on_host: dict[int, list[str]] = {}
        for w, h in host.items():
            self._on_host.setdefault(h, []).append(w)

    def factor(self, worker_id: str) -> float:
        """How much longer than alone a step of ``worker_id`` that starts now takes."""
        others = sum(1 for peer in self._peers[worker_id] if self._busy(peer))
        return max(1.0, (others + 1 + self.background) / self.cores)

    def beside(self, host: int) -> float:
        """The same for a process that is not a worker (the router, the client) on ``host``'s cores: how much longer
        than on an idle machine its work that starts now takes, with the host's busy workers beside it."""
        busy = sum(1 for w in self._on_host.get(host, ()) if self._busy(w))
        return max(1.0, (busy + 1 + self.background) / self.cores)


class SharedTimeModel:
    """One worker's time model on shared cores: its steps as the base model prices them, times the sharing."""

    def __init__(self, base: TimeModel, shared: SharedCores, worker_id: str) -> None:
        self.base, self.shared, self.worker_id = base, shared, worker_id

    def step_s(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> float:
        return self.base.step_s(decode_seqs, decode_context, chunks) * self.shared.factor(self.worker_id)

    def explain(self, decode_seqs: int, decode_context: int, chunks: Sequence[Chunk] = ()) -> dict[str, float | str]:
        return {**self.base.explain(decode_seqs, decode_context, chunks),
                "sharing_factor": self.shared.factor(self.worker_id)}
