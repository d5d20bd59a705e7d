"""What else ran on the cores during a real run: runnable tasks sampled from ``/proc`` (the check's shell; Linux).

The load average cannot say it: it is a one-minute average that still holds the previous run of our own when the
next begins. So while a real run replays, every ``period_s`` each task (thread) of the machine in state R is
counted, as ours (the process trees under ``roots``: the check itself, its platform) or another's, and the means
are kept. The simulator takes the others' mean as its background load (``sim/contention.py``).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

PROC = Path("/proc")


def _stat(path: Path) -> tuple[str, int] | None:
    """(state, parent pid) of a /proc stat file; None when the task is gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[1])


def runnable(roots: set[int]) -> tuple[int, int]:
    """(ours, others): tasks in state R now, ours being those of the processes descended from ``roots``."""
    parents, states = {}, {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(entry / "stat")
            if stat is not None:
                parents[int(entry.name)] = stat[1]
                try:
                    tasks = [s for t in (entry / "task").iterdir() if (s := _stat(t / "stat")) is not None]
                except OSError:
                    tasks = []
                states[int(entry.name)] = sum(state == "R" for state, _ in tasks)
    ours = others = 0
    for pid, count in states.items():
        p, seen = pid, 0
        while p not in roots and p in parents and seen < 64:
            p, seen = parents[p], seen + 1
        if p in roots:
            ours += count
        else:
            others += count
    return ours, others


class RunnableSampler:
    """Samples ``runnable`` in a thread while in its ``with`` block; ``means()`` after."""

    def __init__(self, roots: set[int], period_s: float = 0.5) -> None:
        self.roots, self.period_s = roots | {os.getpid()}, period_s
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="runnable-sampler", daemon=True)

    def __enter__(self) -> RunnableSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            ours, others = runnable(self.roots)
            self.samples.append((max(ours - 1, 0), others))  # the sampler itself runs while it counts

    def means(self) -> dict[str, float]:
        n = max(len(self.samples), 1)
        return {"ours": sum(o for o, _ in self.samples) / n, "others": sum(x for _, x in self.samples) / n,
                "samples": len(self.samples)}
