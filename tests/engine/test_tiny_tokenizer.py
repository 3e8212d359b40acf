"""The tiny tokenizer of the tiny-model fixtures (tests/tiny_tokenizer.py): deterministic, SmolLM2's
special ids and chat template, byte-level so any text round-trips, loaded as the engine loads
SmolLM2's."""
from __future__ import annotations

import json

import pytest

from tests.tiny_tokenizer import BOS, CHAT_TEMPLATE, EOS, UNK, VOCAB_SIZE, build_tokenizer

HOSTILE = ["", "Hi 世界 😀👍🏽 — ok", "z" * 20_000, "\x00\x01\x7f\t\r\n  \u200b\ufeff",
           "naïve façade Ελληνικά русский עברית العربية हिन्दी", "🇫🇷👩‍👩‍👧‍👦" * 50,
           "<|im_start|>user\nnot a turn<|im_end|>", "\U0010ffff\U0001f9ff"]


@pytest.fixture(scope="module")
def tok(tiny_tokenizer_path):
    from genpool.engine.tokenizer import load_tokenizer

    return load_tokenizer(tiny_tokenizer_path)


def test_training_is_deterministic():
    assert build_tokenizer().to_str() == build_tokenizer().to_str()


def test_size_and_special_ids_are_smollm2s(tok, tiny_tokenizer_path):
    assert len(tok) == VOCAB_SIZE
    assert (tok.unk_token, tok.bos_token, tok.eos_token, tok.pad_token) == (UNK, BOS, EOS, EOS)
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 2)
    assert tok("hello")["input_ids"] == tok("hello", add_special_tokens=False)["input_ids"]  # no bos
    assert (tiny_tokenizer_path / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    assert json.loads((tiny_tokenizer_path / "special_tokens_map.json").read_text())["eos_token"] == EOS


def test_chat_template_wraps_turns_in_the_special_tokens(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Where is my parcel?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant")
    assert text.endswith("<|im_start|>user\nWhere is my parcel?<|im_end|>\n<|im_start|>assistant\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids.count(1) == 3 and ids.count(2) == 2 and ids[0] == 1


@pytest.mark.parametrize("text", HOSTILE)
def test_any_text_round_trips(tok, text):
    ids = tok(text)["input_ids"]
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert tok.decode(ids, clean_up_tokenization_spaces=False) == text


def test_every_byte_has_a_token(tok):
    ids = tok(bytes(range(256)).decode("latin-1"))["input_ids"]  # 256 code points, 384 bytes
    assert tok.decode(ids) == bytes(range(256)).decode("latin-1")
    assert max(map(len, tok.get_vocab())) >= 8  # merges, not just bytes


def test_the_engine_loads_the_tiny_checkpoint_with_it(tiny_llama_path):
    from genpool.engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_path), num_kv_blocks=32)
    eng = llm.llm_engine
    assert eng.runner.args.vocab_size == VOCAB_SIZE == len(eng.tokenizer) and eng.eos_token_ids == [2]
    out = llm.generate("Where is my parcel? 😀", SamplingParams(temperature=0, max_tokens=8,
                                                                 ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 8 and out.text == eng.tokenizer.decode(out.token_ids)
