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
    """Feed output token ids in order; get the text that is safe to send. The text sent is kept in pieces and
    only the unsent tail as one string: appending each token's text to the whole output copied all of it per
    token (quadratic in the output's length)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], stop: Sequence[str] = ()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stop = tuple(s for s in stop if s)
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._stop_prefixes = frozenset(s[:k] for s in self._stop for k in range(1, len(s)))  # proper prefixes
        self._sent: list[str] = []  # the text returned so far
        self._unsent = ""  # decoded, not returned yet: a stop string may still begin here (sent text never starts one)
        self.stopped = False
        self.stop_string: str | None = None  # the stop string that matched, once one did

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._sent)

    def add(self, token_ids: Sequence[int]) -> TextPiece:
        """Add output tokens; after a stop string matched, further tokens are ignored."""
        if self.stopped:
            return TextPiece("", True)
        self._unsent += self._detokenizer.step(token_ids)
        return self._release(final=False)

    def finish(self) -> TextPiece:
        """End of stream: flush any held-back text (and an incomplete character, as U+FFFD)."""
        if not self.stopped:
            self._unsent += self._detokenizer.finish()
        return self._release(final=True)

    def _release(self, *, final: bool) -> TextPiece:
        if self.stopped:
            return TextPiece("", True)
        cut = self._find_stop()
        if cut is not None:
            self.stop_string = next(s for s in self._stop if self._unsent.startswith(s, cut))
            self.stopped = True
            return self._send_up_to(cut)
        return self._send_up_to(len(self._unsent) - (0 if final else self._held_back()))

    def _send_up_to(self, end: int) -> TextPiece:
        """Return the unsent text up to ``end``; after a stop, what follows it is dropped."""
        piece, self._unsent = self._unsent[:end], ("" if self.stopped else self._unsent[end:])
        if piece:
            self._sent.append(piece)
        return TextPiece(piece, self.stopped)

    def _find_stop(self) -> int | None:
        """Earliest index in the unsent text where a stop string starts (sent text never starts one: it is
        released only once no suffix of it can begin a stop string)."""
        hits = [i for s in self._stop if (i := self._unsent.find(s)) >= 0]
        return min(hits, default=None)

    def _held_back(self) -> int:
        """Length of the longest unsent suffix that is a proper prefix of some stop string."""
        for length in range(min(len(self._unsent), self._longest_stop - 1), 0, -1):
            if self._unsent[-length:] in self._stop_prefixes:
                return length
        return 0
