"""Prompt log-probabilities (SamplingParams.prompt_logprobs; the gateway's echo): each prompt
token after the first scored by HF transformers' log_softmax on the same checkpoint, whatever the
chunking, the prefix cache or the batch around it; max_tokens=0 scores and generates nothing; a
request that does not ask gets what it got before."""
import pytest
import torch

from genpool.engine import LLM, SamplingParams


def _hf_logprobs(path, ids: list[int]) -> torch.Tensor:
    """[len(ids), V] log_softmax of HF's logits for the prompt (row i predicts token i + 1)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _check(out, ids, ref: torch.Tensor, top: int, atol: float = 1e-4) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        d = plp[pos]
        assert ids[pos] in d
        assert d[ids[pos]] == pytest.approx(float(ref[pos - 1, ids[pos]]), abs=atol)
        want = torch.topk(ref[pos - 1], top).indices.tolist()  # the top alternatives, by id
        assert set(want) <= set(d) and len(d) <= top + 1, (pos, d, want)
        for k in want:
            assert d[k] == pytest.approx(float(ref[pos - 1, k]), abs=atol)


@pytest.mark.parametrize("chunk", [1024, 16])
def test_prompt_logprobs_match_hf_whole_or_chunked(tiny_llama_path, chunk):
    ids = _prompt(50)
    ref = _hf_logprobs(tiny_llama_path, ids)
    with LLM(str(tiny_llama_path), num_kv_blocks=32, max_num_batched_tokens=chunk) as llm:
        out, = llm.generate({"prompt_token_ids": ids},
                            SamplingParams(max_tokens=0, prompt_logprobs=3))
    _check(out, ids, ref, 3)
    assert [(c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [("", [], "length")]


def test_scoring_ignores_the_prefix_cache_and_leaves_others_alone(tiny_llama_path):
    """A cached prompt is computed again for the request that scores it (a cached block's rows
    never ran); its neighbours in the batch generate what they generate alone."""
    ids, other = _prompt(40, 1), _prompt(23, 2)
    ref = _hf_logprobs(tiny_llama_path, ids)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny_llama_path), num_kv_blocks=64, max_num_batched_tokens=32) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": ids}, {"prompt_token_ids": other}], greedy)]  # now cached
        scored = greedy.clone(prompt_logprobs=0, n=2)
        outs = llm.generate([{"prompt_token_ids": ids}, {"prompt_token_ids": other}],
                            [scored, greedy])
        stats = llm.llm_engine.stats()
    _check(outs[0], ids, ref, 0)
    assert [c.token_ids for c in outs[0].outputs] == [alone[0], alone[0]]  # n=2 greedy: same
    assert outs[1].outputs[0].token_ids == alone[1] and outs[1].prompt_logprobs is None
    assert stats.prefix_cache_hits > 0  # the neighbour did hit the cache


def test_max_tokens_zero_needs_prompt_logprobs():
    with pytest.raises(ValueError, match="0 only with prompt_logprobs"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)


def test_n_empty_completions_and_one_token_prompt(tiny_llama_path):
    with LLM(str(tiny_llama_path), num_kv_blocks=16) as llm:
        out, one = llm.generate([{"prompt_token_ids": _prompt(9)}, {"prompt_token_ids": [5]}],
                                SamplingParams(max_tokens=0, prompt_logprobs=1, n=3))
        assert not llm.llm_engine.has_unfinished_requests()
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(not c.token_ids for c in out.outputs)
    assert one.prompt_logprobs == [None] and len(out.prompt_logprobs) == 9


def test_resumed_n_completions_with_max_tokens_zero_end_the_request(tiny_llama_path):
    """A resume builds all n sequences (no forks): max_tokens=0 ends the request once every one
    has computed its prompt, completion 0 having scored it; none stays running (it would hold
    its blocks and be scheduled with no token in every later step)."""
    from genpool.engine.resume import ResumeState

    ids = _prompt(40, seed=3)
    with LLM(str(tiny_llama_path), num_kv_blocks=64, max_num_batched_tokens=16) as llm:
        eng = llm.llm_engine
        sp = SamplingParams(n=2, max_tokens=0, prompt_logprobs=1, temperature=0)
        eng.add_request("a", {"prompt_token_ids": ids}, sp, resume=ResumeState([[], []]))
        outs = []
        while eng.has_unfinished_requests():
            outs += eng.step()
        assert outs[-1].finished and [c.finish_reason for c in outs[-1].outputs] == ["length"] * 2
        _check(outs[-1], ids, _hf_logprobs(tiny_llama_path, ids), 1)
        assert not eng.scheduler.running and eng.block_manager.num_used_blocks == 0
        after = llm.generate({"prompt_token_ids": ids[:5]}, SamplingParams(max_tokens=3))[0]
        assert after.error is None and len(after.outputs[0].token_ids) == 3


def test_a_resume_whose_completion_0_had_ended_still_scores_the_prompt(tiny_llama_path):
    """Completion 0 finished in the earlier run (it is never scheduled again): the first
    completion still running scores the prompt instead."""
    from genpool.engine.resume import ResumeState

    ids = _prompt(20, seed=4)
    sp = SamplingParams(n=2, max_tokens=4, prompt_logprobs=1, temperature=0, ignore_eos=True)
    with LLM(str(tiny_llama_path), num_kv_blocks=64) as llm:
        full = llm.generate({"prompt_token_ids": ids}, sp)[0]
        done = [c.token_ids for c in full.outputs]
        eng = llm.llm_engine
        eng.add_request("a", {"prompt_token_ids": ids}, sp,
                        resume=ResumeState([done[0], done[1][:2]]))
        scored = []
        while eng.has_unfinished_requests():
            scored += [o for o in eng.step() if o.prompt_logprobs is not None]
    assert len(scored) == 1 and scored[0].prompt_logprobs == full.prompt_logprobs


@pytest.mark.checkpoint
def test_smollm2_prompt_logprobs_match_hf(smollm2_path):
    with LLM(str(smollm2_path), dtype="float32", num_kv_blocks=64) as llm:
        ids = llm.get_tokenizer()("The capital of France is Paris. The capital of Italy is Rome.")[
            "input_ids"]
        out, = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=1))
    _check(out, ids, _hf_logprobs(smollm2_path, ids), 1, atol=1e-3)
