import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from genpool.engine.detokenizer import MAX_PENDING, IncrementalDetokenizer

EURO = "\u20ac"  # 3 UTF-8 bytes: e2 82 ac


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.checkpoint)])
def tok(request):
    """Each test runs on the tiny byte-level BPE (tests/tiny_tokenizer.py, always there) and on
    SmolLM2's real tokenizer (its merges and its incomplete byte alphabet) when it is available."""
    from transformers import AutoTokenizer

    if request.param == "tiny":
        path = request.getfixturevalue("tiny_tokenizer_path")
    else:
        path = request.getfixturevalue("smollm2_path")  # skips when the checkpoint is unavailable
    return AutoTokenizer.from_pretrained(str(path))


def _byte_to_char() -> dict[int, str]:
    """GPT-2 byte-level alphabet: every byte has a printable stand-in character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


_VOCABS: dict[str, dict[str, int]] = {}  # by tokenizer folder


def vocab(tok) -> dict[str, int]:
    if tok.name_or_path not in _VOCABS:
        _VOCABS[tok.name_or_path] = tok.get_vocab()
    return _VOCABS[tok.name_or_path]


def byte_ids(tok, data: bytes) -> list[int]:
    """One token per byte (the tokenizer would merge them; the model may not)."""
    v, b2c = vocab(tok), _byte_to_char()
    return [v[b2c[b]] for b in data]


def run(tok, ids, prompt=(), chunks=None, **kw):
    """Feed ids in chunks; return (deltas, stop, flushed, detok)."""
    d = IncrementalDetokenizer(tok, list(prompt), **kw)
    deltas, stop, i = [], None, 0
    for n in chunks or [1] * len(ids):
        delta, stop = d.add(ids[i:i + n])
        deltas.append(delta)
        i += n
        if stop is not None:
            break
    return deltas, stop, d.flush(), d


def test_plain_text_round_trip(tok):
    text = "Hello world! The quick brown fox, 1234 jumps.\n\nNew paragraph  with  spaces."
    ids = tok.encode(text)
    deltas, stop, tail, d = run(tok, ids)
    assert stop is None and "".join(deltas) + tail == text == d.text
    assert all(deltas)  # every ASCII token shows up right away


def test_emoji_and_cjk_split_across_tokens(tok):
    text = "Hi 世界 😀👍🏽 — ok"
    ids = tok.encode(text)
    deltas, _, tail, _ = run(tok, ids)
    assert "".join(deltas) + tail == text
    assert not any("\ufffd" in x for x in deltas)
    assert "" in deltas  # some tokens only carry part of a character


def test_single_byte_tokens_wait_for_the_whole_character(tok):
    ids = tok.encode("a") + byte_ids(tok, EURO.encode()) + tok.encode("b")
    deltas, _, tail, _ = run(tok, ids)
    assert deltas == ["a", "", "", EURO, "b"] and tail == ""


def test_flush_emits_an_unfinished_character(tok):
    ids = tok.encode("x") + byte_ids(tok, EURO.encode()[:2])
    deltas, _, tail, d = run(tok, ids)
    assert deltas == ["x", "", ""]
    assert tail == tok.decode(ids)[1:] and tail.endswith("\ufffd") and d.text == tok.decode(ids)


def test_long_run_of_invalid_bytes_is_not_held_forever(tok):
    bad = b"\xe2" * (3 * MAX_PENDING)
    ids = byte_ids(tok, bad + EURO.encode()) + tok.encode("z")
    deltas, _, tail, _ = run(tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == "\ufffd" * len(bad) + EURO + "z"
    assert "".join(deltas[: 2 * MAX_PENDING]).count("\ufffd") >= MAX_PENDING


def test_prompt_context_and_prompt_ending_mid_character(tok):
    out = tok.encode(" answer is 42")
    for prompt in (tok.encode("The question:"), byte_ids(tok, EURO.encode()[:2]), []):
        deltas, _, tail, _ = run(tok, out, prompt=prompt)
        assert "".join(deltas) + tail == tok.decode(out)
    # output that completes a character the prompt started decodes like the output alone
    out2 = byte_ids(tok, EURO.encode()[2:]) + tok.encode("ok")
    deltas, _, tail, _ = run(tok, out2, prompt=byte_ids(tok, EURO.encode()[:2]))
    assert "".join(deltas) + tail == tok.decode(out2)


def test_special_tokens(tok):
    ids = tok.encode("hi") + [tok.eos_token_id] + tok.encode(" there")
    deltas, _, tail, _ = run(tok, ids)
    assert "".join(deltas) + tail == "hi there"
    deltas, _, tail, _ = run(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) + tail == "hi<|im_end|> there"
    many = tok.encode("a") + [tok.eos_token_id] * 50 + tok.encode("b")
    deltas, _, tail, _ = run(tok, many)
    assert "".join(deltas) + tail == "ab"


def test_stop_string_truncates_and_is_reported(tok):
    ids = tok.encode("Hello world. STOP here please")
    deltas, stop, tail, d = run(tok, ids, stop=["STOP"])
    assert stop == "STOP" and "".join(deltas) + tail == "Hello world. " == d.text
    assert d.stop_reason == "STOP" and d.finished and tail == ""
    assert d.add(tok.encode(" more")) == ("", None)
    deltas, stop, tail, d = run(tok, ids, stop=["STOP"], include_stop_str_in_output=True)
    assert "".join(deltas) + tail == "Hello world. STOP"


def test_stop_prefix_is_held_back_until_decided(tok):
    ids = byte_ids(tok, b"ab##c##")  # one token per character
    deltas, stop, tail, _ = run(tok, ids, stop=["###"])
    assert deltas == ["a", "b", "", "", "##c", "", ""] and stop is None
    assert tail == "##"  # flush loses nothing of a held-back stop prefix
    deltas, stop, tail, d = run(tok, byte_ids(tok, b"ab####z"), stop=["###"])
    assert deltas == ["a", "b", "", "", ""] and stop == "###" and d.text == "ab"


def test_stop_strings_ignored_before_min_tokens(tok):
    ids = byte_ids(tok, b"aXbXcX")
    deltas, stop, _, d = run(tok, ids, stop=["X"], min_tokens=4)
    # the X at token 2 is ignored; the one at token 4 (the 4th output token) stops
    assert stop == "X" and d.text == "aXb" and d.num_tokens == 4
    deltas, stop, _, d = run(tok, byte_ids(tok, b"abXYz"), stop=["XY"], min_tokens=4)
    assert stop == "XY" and d.text == "ab"  # a held-back prefix still counts once allowed
    deltas, stop, tail, d = run(tok, byte_ids(tok, b"XYab"), stop=["XY"], min_tokens=3)
    assert stop is None and "".join(deltas) + tail == "XYab"


def test_stop_string_inside_one_token_and_at_the_start(tok):
    ids = tok.encode("The end.\n\nNext")
    deltas, stop, _, d = run(tok, ids, chunks=[len(ids)], stop=["\n\n"])
    assert (deltas, stop, d.text) == (["The end."], "\n\n", "The end.")
    deltas, stop, _, d = run(tok, tok.encode("\n\nNext"), stop=["\n\n"])
    assert stop == "\n\n" and d.text == ""


def test_earliest_stop_wins(tok):
    ids = tok.encode("one two three four")
    _, stop, _, d = run(tok, ids, chunks=[len(ids)], stop=["four", "two"])
    assert stop == "two" and d.text == "one "


def test_stop_string_split_by_a_broken_character(tok):
    ids = byte_ids(tok, ("x" + EURO + "y").encode())
    deltas, stop, _, d = run(tok, ids, stop=[EURO])
    assert stop == EURO and d.text == "x"


# ---- properties -------------------------------------------------------------------------------
PROPERTY = settings(max_examples=50, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


def _vocab_ids(tok):
    short = sorted(i for t, i in vocab(tok).items() if len(t) <= 2)
    return st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(short))


def _feed_all(tok, ids, prompt, chunk_sizes, **kw):
    d = IncrementalDetokenizer(tok, prompt, **kw)
    out, i, k = [], 0, 0
    while i < len(ids):
        n = chunk_sizes[k % len(chunk_sizes)]
        delta, stop = d.add(ids[i:i + n])
        out.append(delta)
        assert stop is None
        i, k = i + n, k + 1
    out.append(d.flush())
    return out, d


@PROPERTY
@given(data=st.data(), skip=st.booleans())
def test_property_deltas_concatenate_to_decode(tok, data, skip):
    ids = data.draw(st.lists(_vocab_ids(tok), max_size=40))
    prompt = data.draw(st.lists(_vocab_ids(tok), max_size=8))
    chunks = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=5))
    out, d = _feed_all(tok, ids, prompt, chunks, skip_special_tokens=skip)
    ref = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(out) == ref == d.text


# SmolLM2's byte alphabet lacks a few bytes (some controls, 0xc0/0xc1, 0xf1, 0xf2, 0xf5..0xff):
# stay with characters it can encode (U+10000..U+3FFFF start with 0xf0)
_ENCODABLE = st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",),
                           exclude_characters="\x04\x06\x13\x14\x16\x1d")


@PROPERTY
@given(text=st.text(alphabet=_ENCODABLE, max_size=40), split_bytes=st.booleans())
def test_property_text_round_trip(tok, text, split_bytes):
    ids = byte_ids(tok, text.encode()) if split_bytes else tok.encode(text)
    out, _ = _feed_all(tok, ids, [], [1])
    assert "".join(out) == text
    assert not any("\ufffd" in x for x in out)


@PROPERTY
@given(text=st.text(alphabet="ab #\n", max_size=30),
       stop=st.text(alphabet="ab #\n", min_size=1, max_size=3), include=st.booleans())
def test_property_stop_string(tok, text, stop, include):
    ids = byte_ids(tok, text.encode())
    d = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
    pieces, found = [], None
    for t in ids:
        delta, found = d.add([t])
        pieces.append(delta)
        assert text.startswith("".join(pieces))  # never emits something it has to take back
        if found:
            break
    pieces.append(d.flush())
    pos = text.find(stop)
    if pos == -1:
        assert found is None and "".join(pieces) == text
    else:
        assert found == stop
        assert "".join(pieces) == text[: pos + (len(stop) if include else 0)]


def _pending(text: str, stops: list[str]) -> int:
    """The longest suffix of text that is a proper prefix of a stop string (held back)."""
    return max((n for n in range(1, len(text) + 1) for s in stops
                if n < len(s) and s.startswith(text[-n:])), default=0)


@PROPERTY
@given(text=st.text(alphabet="ab #", max_size=40),
       stops=st.lists(st.text(alphabet="ab #", min_size=1, max_size=9), min_size=1, max_size=4))
def test_property_emits_all_but_the_pending_stop_prefix(tok, text, stops):
    """After each token the emitted text is the decoded text less exactly its longest suffix that
    could still become a stop string: held back no more and no less (the held length is tracked
    from the previous one, not rescanned over the longest stop's length every token)."""
    ids = byte_ids(tok, text.encode())
    d = IncrementalDetokenizer(tok, [], stop=stops)
    for i, t in enumerate(ids):
        _, found = d.add([t])
        if found:
            break
        seen = text[:i + 1]
        assert d.text == seen[:len(seen) - _pending(seen, stops)]
