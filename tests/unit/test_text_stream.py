"""TextStream: incremental text with stop strings held back, cut, and flushed at the end."""

from __future__ import annotations

import string

import pytest
import tokenizers
from tokenizers import Regex, decoders, models, pre_tokenizers

from engine.tokenizer import SpecialTokens, Tokenizer
from engine.text_stream import TextStream

CHARS = string.ascii_letters + string.digits + " .,!?\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """One token per character: token boundaries are exactly where the test puts them."""
    backend = tokenizers.Tokenizer(models.WordLevel({c: i for i, c in enumerate(CHARS)}, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(".|\n"), "isolated")
    backend.decoder = decoders.Fuse()
    return Tokenizer(backend, SpecialTokens(strings={}, bos_token_id=None, eos_token_ids=frozenset()), None)


def ids(text: str) -> list[int]:
    return [CHARS.index(c) for c in text]


def feed(stream: TextStream, text: str) -> list[str]:
    return [stream.add(ids(c)).text for c in text]


def test_without_stop_strings_every_token_is_sent_at_once(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ())
    assert feed(stream, "Hi there") == list("Hi there")
    assert stream.finish().text == "" and stream.text == "Hi there"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ("END",))
    assert feed(stream, "aEN") == ["a", "", ""]
    assert stream.add(ids("x")).text == "ENx"  # "ENx" can no longer become "END"
    assert not stream.stopped


def test_stop_string_cuts_text_before_it(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ("END",))
    pieces = feed(stream, "abEND")
    assert pieces == ["a", "b", "", "", ""] and stream.stopped
    assert stream.text == "ab"
    assert stream.add(ids("zz")).text == "" and stream.finish().text == ""


def test_stop_string_inside_one_chunk(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ("stop",))
    piece = stream.add(ids("go stop now"))
    assert (piece.text, piece.stopped) == ("go ", True)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ("cd", "b"))
    piece = stream.add(ids("abcd"))
    assert (piece.text, piece.stopped, stream.text) == ("a", True, "a")


def test_overlapping_prefixes_are_found(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ("aab",))
    assert feed(stream, "aaab") == ["", "", "a", ""] and stream.stopped and stream.text == "a"


def test_finish_flushes_held_back_text(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ("END",))
    assert feed(stream, "xEN") == ["x", "", ""]
    piece = stream.finish()
    assert (piece.text, piece.stopped, stream.text) == ("EN", False, "xEN")


def test_stop_string_at_the_very_start(tokenizer):
    stream = TextStream(tokenizer, ids("Q"), ("\n",))
    piece = stream.add(ids("\n"))
    assert (piece.text, piece.stopped, stream.text) == ("", True, "")


def test_random_streams_send_exactly_the_text_before_the_first_stop(tokenizer):
    """Whatever the chunking and stops: the pieces add up to the text cut before the earliest stop string, no
    piece is sent that a later token turns into a stop, and ``text`` is what was sent."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("ab .\n") for _ in range(rng.randint(1, 40)))
        stops = ["".join(rng.choice("ab .\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        starts = [i for s in stops if (i := text.find(s)) >= 0]
        expected = text[: min(starts)] if starts else text
        stream, sent, i = TextStream(tokenizer, ids("Q"), stops), [], 0
        while i < len(text) and not stream.stopped:
            k = rng.randint(1, 5)
            sent.append(stream.add(ids(text[i : i + k])).text)
            assert expected.startswith("".join(sent))  # nothing sent that a stop later cuts
            i += k
        sent.append(stream.finish().text)
        assert "".join(sent) == expected == stream.text
        assert stream.stopped == bool(starts)
