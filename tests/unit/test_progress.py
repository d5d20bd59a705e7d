"""Progress of a long load: a redrawn bar on a terminal, one log line per quarter in a worker's log."""

from __future__ import annotations

import io
import logging

from engine.model.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_that_ends_at_the_total():
    stream = _Terminal()
    assert list(Progress(list(range(10)), "dequantizing x.gguf", unit="tensors", stream=stream)) == list(range(10))
    frames = stream.getvalue().split("\r")
    assert frames[-1] == "dequantizing x.gguf [" + "#" * 30 + "] 10/10 tensors " + frames[-1].split()[-2] + " s\n"


def test_a_log_gets_one_line_per_quarter(caplog):
    caplog.set_level(logging.INFO, logger="engine.model.progress")
    assert len(list(Progress(list(range(100)), "loading", stream=io.StringIO()))) == 100
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(": ")[1].split(" ")[0] for line in lines] == ["25/100", "50/100", "75/100", "100/100"]
