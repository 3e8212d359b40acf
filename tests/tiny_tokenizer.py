"""A tiny byte-level BPE tokenizer in SmolLM2's format, so tiny-model tests need no checkpoint.

`write_tiny_tokenizer(dir)` trains a GPT-2-style byte-level BPE (the `tokenizers` library, no
download) on a fixed corpus of text the repo already has (the benchmark workload's paragraphs and
instructions, the test prompts, the chat template's role lines) and writes the same files SmolLM2
ships (tokenizer.json, tokenizer_config.json, chat_template.jinja) plus special_tokens_map.json,
so `AutoTokenizer.from_pretrained(dir)` and the engine load it the way they load SmolLM2's.

* VOCAB_SIZE = 2048 ids: the 3 special tokens, the 256 byte symbols, then 1789 merges. The corpus
  supports about 2136, so the size is always reached; training is deterministic (same corpus,
  same merges, any thread count).
* Special ids as SmolLM2: 0 `<|endoftext|>` (unk), 1 `<|im_start|>` (bos), 2 `<|im_end|>` (eos,
  pad). Like SmolLM2, encoding adds no bos/eos, and the chat template is SmolLM2's.
* Byte-level: every byte has a token, so any text (emoji, CJK, lone surrogates as the library
  handles them for SmolLM2) encodes, and decoding the ids gives the text back.
"""
from __future__ import annotations

import json
from pathlib import Path

VOCAB_SIZE = 2048
UNK, BOS, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK, BOS, EOS]  # ids 0, 1, 2
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
# SmolLM2-135M's chat_template.jinja, verbatim
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\n" + DEFAULT_SYSTEM + "<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def corpus() -> list[str]:
    """The training text: fixed strings already in the repo."""
    from benchmarks.workload import INSTRUCTIONS, PARAGRAPHS
    from tests import prompts

    roles = [f"system\n{DEFAULT_SYSTEM}\n", "user\n", "assistant\n"]
    return (list(PARAGRAPHS) + list(INSTRUCTIONS) + list(prompts.QUESTIONS)
            + [prompts.SHARED_SYSTEM] + list(prompts.SHARED_QUESTIONS) + roles)


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """The trained `tokenizers.Tokenizer` (SmolLM2's pipeline: no normalizer, byte-level
    pre-tokenizer and decoder, a post-processor that adds nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B:1", special_tokens=[])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=1, show_progress=False)
    tk.train_from_iterator(corpus(), trainer)
    if tk.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tiny tokenizer reached {tk.get_vocab_size()} ids, not {vocab_size}: "
                           f"the corpus is too small")
    for i, tok in enumerate(SPECIAL_TOKENS):
        assert tk.token_to_id(tok) == i, (tok, tk.token_to_id(tok))
    return tk


def write_tiny_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Write tokenizer.json, tokenizer_config.json, chat_template.jinja and
    special_tokens_map.json into `out` (created if missing); returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(vocab_size).save(str(out / "tokenizer.json"))
    config = {"backend": "tokenizers", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
              "unk_token": UNK, "model_max_length": 1000000000000000019884624838656,
              "tokenizer_class": "TokenizersBackend"}  # SmolLM2's, as transformers 5 wrote it
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "unk_token": UNK}
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return out
