"""Speculative decoding with n-gram drafts (engine/speculative.py): greedy output identical to
decoding without drafts (stops, penalties, preemption, chunked prefill included), the sampled
rule distributed as the target, drafts off where asked or where the batch is large."""
import collections

import pytest
import torch

from genpool.engine import LLM, SamplingParams
from genpool.engine.sampler import Sampler, SampleRow
from genpool.engine.speculative import propose, verify

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "disable_by_batch_size": 16}  # correctness, not the default


def test_propose_takes_what_followed_the_latest_longest_match():
    ids = [5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 3, 5, 6, 7]
    assert propose(ids, 3, 1, 3) == [2, 3, 5]  # "5 6 7" last seen before position 9
    assert propose(ids, 1, 1, 3) == [2]
    assert propose([1, 2, 3, 4], 3, 1, 3) == []  # 4 never occurred before
    assert propose([9, 9], 4, 1, 2) == [9]
    # bytes of ids that straddle token boundaries never count as a match
    assert propose([0x0100, 0x0200, 7, 0x02, 0x01], 2, 2, 2) == []


def _generate(path, prompts, params, spec=None, **kw):
    with LLM(str(path), num_kv_blocks=kw.pop("num_kv_blocks", 64), speculative_config=spec,
             **kw) as llm:
        outs = llm.generate(prompts, params)
        return [[c.token_ids for c in o.outputs] for o in outs], llm.llm_engine.speculator


PROMPTS = [{"prompt_token_ids": [3 + (i * 7 + j * 13) % 50 for j in range(n)]}
           for i, n in enumerate((12, 30, 5, 41))]


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8"])
@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, repetition_penalty=1.2,
                   logit_bias={7: 2.0}),
    SamplingParams(temperature=0, max_tokens=40, min_tokens=20, stop_token_ids=[17, 23]),
])
def test_greedy_output_is_identical_with_drafts(tiny_llama_path, params, kv):
    # over a narrow cache too: a verification's rows attend over K/V rounded when written
    plain, _ = _generate(tiny_llama_path, PROMPTS, params, kv_cache_dtype=kv)
    spec, speculator = _generate(tiny_llama_path, PROMPTS, params, NGRAM, kv_cache_dtype=kv)
    assert spec == plain
    assert speculator.accepted > 0  # the drafts were used, not only proposed


def test_stop_strings_inside_an_accepted_draft(tiny_llama_path):
    """A stop string completed by a token inside a verified draft ends the text there, and the
    draft's later tokens are dropped: the same text and tokens as without drafts."""
    base = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with LLM(str(tiny_llama_path), num_kv_blocks=64) as llm:
        text = llm.generate(PROMPTS[1], base)[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    params = base.clone(stop=[stop])
    plain, _ = _generate(tiny_llama_path, PROMPTS, params)
    spec, speculator = _generate(tiny_llama_path, PROMPTS, params, NGRAM)
    assert spec == plain and speculator.accepted > 0


def test_preemption_and_chunked_prefill_with_drafts(tiny_llama_path):
    """A cache too small for the batch preempts and recomputes; drafts change nothing."""
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    plain, _ = _generate(tiny_llama_path, PROMPTS, params, num_kv_blocks=14,
                         max_num_batched_tokens=16)
    spec, speculator = _generate(tiny_llama_path, PROMPTS, params, NGRAM, num_kv_blocks=14,
                                 max_num_batched_tokens=16)
    assert spec == plain and speculator.drafted > 0


def test_drafts_off_per_job_and_for_large_batches(tiny_llama_path):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    _, off = _generate(tiny_llama_path, PROMPTS, params.clone(speculative=False), NGRAM)
    assert off.drafted == 0
    _, crowded = _generate(tiny_llama_path, PROMPTS, params, {**NGRAM, "disable_by_batch_size": 3})
    one, alone = _generate(tiny_llama_path, PROMPTS[:1], params.clone(speculative=True))
    assert crowded.drafted == 0 < alone.drafted  # 4 running > 3; a job may opt in alone
    assert one == _generate(tiny_llama_path, PROMPTS[:1], params)[0]


def test_an_opted_in_job_drafts_with_the_engines_settings_without_a_method(tiny_llama_path):
    """Without a method only jobs that ask draft, and they draft as the engine's settings say
    (here 1 token at most), not with the built-in defaults."""
    seen = []
    with LLM(str(tiny_llama_path), num_kv_blocks=64, num_speculative_tokens=1, speculative_max_batch=16) as llm:
        speculator = llm.llm_engine.speculator
        draft = speculator.draft

        def recording(running):
            draft(running)
            seen.extend(len(seq.draft) for seq in running)
        speculator.draft = recording
        llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, speculative=True))
    assert speculator.drafted > 0 and max(seen) == 1


@pytest.mark.parametrize("spec, names", [
    ({"method": "ngram", "disable_by_batch_size": "8"}, "speculative_max_batch"),
    ({"method": "ngram", "disable_by_batch_size": None}, "speculative_max_batch"),
    ({"method": "ngram", "disable_by_batch_size": 0}, "speculative_max_batch"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_max": 2.5}, "prompt_lookup_max"),
    ({"num_speculative_tokens": 8}, "method"),
    ({"method": None, "num_speculative_tokens": 8}, "method"),
    ("ngram", "speculative_config must be a dict"),
    (["ngram"], "speculative_config must be a dict"),
])
def test_a_bad_speculative_config_is_refused_before_the_model_loads(tiny_llama_path, spec, names):
    """A value of the wrong type or out of range fails at construction with its name, instead
    of failing every later step (a string batch limit broke even jobs that opted out)."""
    with pytest.raises(ValueError, match=names):
        LLM(str(tiny_llama_path), speculative_config=spec)


def test_seeded_sampling_is_identical_with_drafts(tiny_llama_path):
    """Each row's token is the sampler's own keyed draw: seeded outputs do not change."""
    params = SamplingParams(temperature=0.3, top_p=0.9, seed=5, max_tokens=50, ignore_eos=True, n=2)
    plain, _ = _generate(tiny_llama_path, PROMPTS, params)
    spec, speculator = _generate(tiny_llama_path, PROMPTS, params, NGRAM)
    assert spec == plain and speculator.accepted > 0
    assert all(len(c) == 50 for o in spec for c in o)


def test_the_sampled_rule_is_distributed_as_the_target():
    """verify() on fixed logits: whatever the draft, the first token it returns is distributed
    as the row's own distribution, and the draft is accepted with probability p(draft)."""
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]]))
    target = torch.softmax(logits[0], dim=-1)
    sampler, n = Sampler(), 6000
    for draft in ([1], [3]):  # a likely and an unlikely draft
        counts = collections.Counter()
        for seed in range(n):
            row = SampleRow(SamplingParams(temperature=1.0, seed=seed), [0], [2], seed, (), 0)
            counts[verify(sampler, logits.clone(), row, draft)[0]] += 1
        freq = torch.tensor([counts[i] / n for i in range(4)])
        assert torch.allclose(freq, target, atol=0.025), (draft, freq)


@pytest.mark.checkpoint
@pytest.mark.parametrize("mode", [{}, {"quantization": "int8", "kv_cache_dtype": "int8"}], ids=["fp32", "int8-kvint8"])
def test_smollm2_copy_heavy_greedy_is_identical(smollm2_path, mode):
    doc = ("Invoice 4471 was issued on 3 March to Harbor Supplies Ltd for 12 steel brackets at "
           "4.50 each, 3 oak panels at 27.00 each and one delivery fee of 15.00.")
    prompt = [{"role": "user", "content": f"Copy every line item of this invoice, one per line:\n{doc}"}]
    params = SamplingParams(temperature=0, max_tokens=64)
    with LLM(str(smollm2_path), num_kv_blocks=64, **mode) as llm:
        plain = llm.chat(prompt, params)[0].outputs[0].token_ids
    with LLM(str(smollm2_path), num_kv_blocks=64, speculative_config=NGRAM, **mode) as llm:
        spec = llm.chat(prompt, params)[0].outputs[0].token_ids
        accepted = llm.llm_engine.speculator.accepted
    assert spec == plain and accepted > 0


def test_verification_steps_run_as_decode_rows(tiny_llama_path):
    # a verifying sequence's k + 1 rows each attend to their own prefix, so the step runs on the
    # one-call decode stack (engine/model_runner.py, prepare) instead of layer by layer
    with LLM(str(tiny_llama_path), num_kv_blocks=64, speculative_config=NGRAM) as llm:
        runner = llm.llm_engine.runner
        if runner.decode_stack is None:
            pytest.skip("this backend has no decode stack")
        stack, rows = runner.decode_stack, []
        runner.decode_stack = lambda x, *a: rows.append(x.shape[0]) or stack(x, *a)
        llm.generate(PROMPTS[1:2], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        assert llm.llm_engine.speculator.accepted > 0
    assert max(rows) > 1  # one sequence: only a verification gives the stack several rows
