"""A request's output text: incremental detokenization plus stop strings. Pure logic, no I/O.

Text that could still turn out to be the start of a stop string is held back, so a client never sees
text that a later token turns into a stop; when a stop string appears, the text is cut right before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str  # new text to send (possibly empty)
    stopped: bool  # a stop string matched: the request is finished (reason STOP)


class TextStream:
    """Feed output token ids in order; get the text that is safe to send."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._text = ""  # everything decoded so far (cut at the stop string once one matched)
        self._num_sent = 0  # chars of _text already returned
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched, once one did

    @property
    def text(self) -> str:
        """All text returned so far."""
        return self._text[: self._num_sent]

    def add(self, token_ids: Sequence[int]) -> TextPiece:
        """Add output tokens; after a stop string matched, further tokens are ignored."""
        if self.stopped:
            return TextPiece("", True)
        self._text += self._detokenizer.step(token_ids)
        return self._release(final=False)

    def finish(self) -> TextPiece:
        """End of stream: flush any held-back text (and an incomplete character, as U+FFFD)."""
        if not self.stopped:
            self._text += self._detokenizer.finish()
        return self._release(final=True)

    def _release(self, *, final: bool) -> TextPiece:
        if self.stopped:
            return TextPiece("", True)
        cut = self._find_stop()
        if cut is not None:
            self.stop_string = next(s for s in self._stop if self._text.startswith(s, cut))
            self._text, self.stopped = self._text[:cut], True
            return self._send_up_to(cut)
        return self._send_up_to(len(self._text) - (0 if final else self._held_back()))

    def _send_up_to(self, end: int) -> TextPiece:
        piece = self._text[self._num_sent : end]
        self._num_sent = max(self._num_sent, end)
        return TextPiece(piece, self.stopped)

    def _find_stop(self) -> int | None:
        """Earliest index where a stop string starts in unsent text (sent text never starts one: it is
        released only once no suffix of it can begin a stop string)."""
        hits = [i for s in self._stop if (i := self._text.find(s, self._num_sent)) >= 0]
        return min(hits, default=None)

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        unsent = len(self._text) - self._num_sent
        for length in range(min(unsent, self._longest_stop - 1), 0, -1):
            tail = self._text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
