"""Progress of a long load: a bar on a terminal, a log line per quarter otherwise (worker logs)."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
_BAR_WIDTH = 30
_MIN_REDRAW_S = 0.1


class Progress(Iterable[T]):
    """Iterate ``items`` and show how far along it is: ``for t in Progress(tensors, "dequantizing"): ...``."""

    def __init__(self, items: Sequence[T], label: str, *, unit: str = "items", stream=None) -> None:
        self._items = items
        self._label = label
        self._unit = unit
        self._stream = stream if stream is not None else sys.stderr
        self._bar = bool(getattr(self._stream, "isatty", lambda: False)())

    def __iter__(self) -> Iterator[T]:
        total = len(self._items)
        started = last_drawn = time.monotonic()
        next_quarter = 1
        for done, item in enumerate(self._items, 1):
            yield item
            now = time.monotonic()
            if self._bar and (now - last_drawn >= _MIN_REDRAW_S or done == total):
                self._draw(done, total, now - started)
                last_drawn = now
            elif not self._bar and done * 4 >= next_quarter * total:
                logger.info("%s: %d/%d %s (%.1f s)", self._label, done, total, self._unit, now - started)
                next_quarter = done * 4 // total + 1
        if self._bar and total:
            self._stream.write("\n")
            self._stream.flush()

    def _draw(self, done: int, total: int, elapsed_s: float) -> None:
        filled = _BAR_WIDTH * done // total
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        self._stream.write(f"\r{self._label} [{bar}] {done}/{total} {self._unit} {elapsed_s:.1f} s")
        self._stream.flush()
