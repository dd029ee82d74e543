"""TextStream: the text a streamed completion sends, token by token, with SmolLM2's real
tokenizer (multi-byte characters split across tokens, stop strings across tokens)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.engine import SMOLLM2, load_tokenizer
from kvxfer.modelfiles.tokenizer import Tokenizer
from kvxfer.router.text import TextStream

TOK = load_tokenizer(SMOLLM2)
assert isinstance(TOK, Tokenizer)
TEXTS = ["The capital of France is Paris. 🇫🇷 Ünïcödé, 東京, 2024!", "def f(x):\n    return x + 1\n", "a" * 40,
         "Paris\nParis\n\nEND here"]


def _stream(ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], TextStream]:
    texts = TextStream(TOK, stop)
    pieces = []
    for token in ids:
        pieces.append(texts.feed(token))
        if texts.stopped:
            break
    pieces.append(texts.finish())
    return pieces, texts


@pytest.mark.parametrize("text", TEXTS)
def test_the_pieces_add_up_to_the_decoded_text_and_never_hold_half_a_character(text: str) -> None:
    ids = TOK.encode(text)
    pieces, texts = _stream(ids)
    assert "".join(pieces) == TOK.decode(ids) == text == texts.text
    assert not any("\ufffd" in p for p in pieces)
    # A flag is more than one token: a piece may be empty while a character is incomplete.
    assert len(pieces) == len(ids) + 1


def test_text_stops_before_the_first_stop_string_even_across_tokens() -> None:
    ids = TOK.encode(TEXTS[3])
    pieces, texts = _stream(ids, ("\n\n", "here"))
    assert "".join(pieces) == "Paris\nParis" and texts.stopped
    # Nothing of the stop string was ever sent, though "\n" came a token before the second one.
    assert all("\n\n" not in "".join(pieces[: i + 1]) for i in range(len(pieces)))
    assert texts.feed(ids[-1]) == "" and texts.finish() == ""


def test_text_that_may_begin_a_stop_string_is_held_until_it_cannot() -> None:
    ids = TOK.encode("Paris. Paris is")
    texts = TextStream(TOK, ("Paris is nice",))
    sent = "".join(texts.feed(t) for t in ids)
    assert not texts.stopped and "Paris. Paris is".startswith(sent) and len(sent) <= len("Paris. Paris is") - 12
    assert sent + texts.finish() == "Paris. Paris is"  # the end of the completion releases it


def _first_stop(ids: list[int], stops: list[str]) -> tuple[str, bool]:
    """What a streamed completion must give: the text is final a whole character at a time
    (a token that ends inside one adds nothing yet), and generation stops at the first token
    after which the final text holds a stop string, cut where the earliest of those starts.
    A stop that would start earlier but ends later never comes: generation has stopped."""
    for k in range(1, len(ids) + 1):
        text = TOK.decode(ids[:k])
        if text.endswith("\ufffd"):
            continue
        found = [i for i in (text.find(s) for s in stops) if i >= 0]
        if found:
            return text[: min(found)], True
    full = TOK.decode(ids)  # a trailing partial character, as the decoder renders it
    found = [i for i in (full.find(s) for s in stops) if i >= 0]
    return (full[: min(found)], True) if found else (full, False)


def test_a_stop_that_completes_first_wins_over_one_that_starts_earlier_but_ends_later() -> None:
    # Hypothesis found it: "ab " with stops "ab " and "b". After "ab", "b" is there and the
    # completion ends; the " " that would complete "ab " is never generated.
    ids = TOK.encode("ab ")
    assert [TOK.decode([i]) for i in ids] == ["ab", " "]
    pieces, texts = _stream(ids, ("ab ", "b"))
    assert "".join(pieces) == "a" == _first_stop(ids, ["ab ", "b"])[0] and texts.stopped


ALPHABET = st.sampled_from(list("ab cé東🇫\n."))  # one alphabet for both: Hypothesis 6's shrinker
# raised ValueError inside itself when two text strategies had different ones (CI, 2026-12-02).


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=ALPHABET, min_size=0, max_size=30),
       st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=3), max_size=3))
def test_streamed_text_is_the_decoded_text_cut_at_the_first_stop(text: str, stops: list[str]) -> None:
    ids = TOK.encode(text)
    pieces, texts = _stream(ids, tuple(stops))
    want, stopped = _first_stop(ids, stops)
    assert "".join(pieces) == want and texts.stopped == stopped
