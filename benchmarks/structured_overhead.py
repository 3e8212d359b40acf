"""Per-step cost of the structured-output hooks alone (no model): what a step pays for its
constrained rows, and for its unconstrained ones.

Builds 48 sequences with the extraction schemas of benchmarks/records.py (SmolLM2's tokenizer),
then runs the engine's own hooks as a step does: start_masks (fill on the helper thread),
apply_masks on a [48, V] logits tensor, a pick among the allowed tokens, accept. Reported: mean
microseconds per step with 0, 24 and 48 constrained rows among 48, and the compile time of each
distinct schema. Compare with the decode step time of the same batch (structured_bench.py).

  python benchmarks/structured_overhead.py --steps 40
"""
from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, last: benchmarks.* and tests.* only, installed packages first

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from benchmarks.records import make_cases  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/genpool/models/smollm2-135m"))
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()

    from genpool.engine.sampling_params import SamplingParams
    from genpool.engine.sequence import Sequence
    from genpool.engine.structured import StructuredOutputs
    from genpool.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(a.model)
    vocab = 49152
    so = StructuredOutputs(tok, vocab, tok.eos_token_id)
    cases = make_cases(48, seed=7)
    report: dict = {}
    for n_con in (0, 24, 48):
        seqs = []
        for i, c in enumerate(cases):
            con = i % (48 // n_con) == 0 if n_con else False
            sp = SamplingParams(max_tokens=256, structured_outputs={"json": c.schema} if con else None)
            seq = Sequence(f"r{i}", [1, 2, 3], sp)
            seq.num_computed_tokens = 2  # one new token this step: every row samples
            if con:
                so.track(seq)
            seqs.append(seq)
        while so.pending:
            so.poll()
            so.wait_pending(0.01)
        times = []
        logits = torch.randn(48, vocab)
        for _ in range(a.steps):
            t0 = time.perf_counter()
            job = so.start_masks(seqs)
            so.apply_masks(job, logits)
            tokens = [int(row.argmax()) for row in logits] if n_con else []
            so.accept(seqs, tokens) if n_con else None
            times.append(time.perf_counter() - t0)
            for s in seqs:  # a finished matcher would only allow EOS: start it over
                if s.matcher is not None and s.matcher.is_stopped():
                    s.matcher.reset()
            logits = torch.randn(48, vocab)
        report[f"{n_con}_of_48_constrained_us"] = 1e6 * statistics.mean(times)
        print(f"{n_con:2d}/48 constrained rows: {1e6 * statistics.mean(times):8.1f} us per step "
              f"(median {1e6 * statistics.median(times):.1f})", flush=True)
    ct = so.cache.compile_times
    report["compile_ms"] = {"n": len(ct), "mean": 1000 * statistics.mean(ct),
                            "median": 1000 * statistics.median(ct), "max": 1000 * max(ct)}
    report["cache"] = so.cache.stats()
    print(json.dumps(report, indent=2))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    so.close()


if __name__ == "__main__":
    main()
