"""What long stop strings cost the detokenizer per output token (engine/detokenizer.py): SmolLM2's
tokenizer over 1,500 tokens of text, with no stop strings, with 16 random stop strings of 1,024
characters (the wire's limits: nothing matches, the common case), and with 16 that the text keeps
almost matching. It runs on the engine's loop thread for every sequence of a step, so a job's stop
strings cost every job in the batch.

    python benchmarks/stop_strings.py
"""
from __future__ import annotations

import os
import random
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    from transformers import AutoTokenizer

    from genpool.engine.detokenizer import IncrementalDetokenizer
    from genpool.engine.models.registry import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))
    text = "The quick brown fox jumps over the lazy dog. " * 200
    ids = tok(text)["input_ids"][:1500]
    rng = random.Random(0)
    cases = {"no stop strings": [],
             "16 random x 1,024 chars": ["".join(rng.choice("abcdefgh ") for _ in range(1024)) for _ in range(16)],
             "16 near-matches x 1,024 chars": [text[:1023] + "#" for _ in range(16)]}
    for name, stops in cases.items():
        best = float("inf")
        for _ in range(3):
            d = IncrementalDetokenizer(tok, [1, 2, 3], stop=stops)
            t0 = time.perf_counter()
            for i in ids:
                d.add([i])
            best = min(best, time.perf_counter() - t0)
        print(f"{name:32s} {best / len(ids) * 1e6:8.1f} us a token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
