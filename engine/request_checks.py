"""What LLMEngine.add_request refuses before anything is queued, and the prompt forms it takes.

Every refusal is a ValueError whose message the caller can act on (workers/jobs.py ends the job
with it as invalid_request, or reruns a job whose resume log was refused from the start): an empty
or over-long prompt, token ids outside the vocabulary (prompt, logit_bias, stop_token_ids), and a
resume log this engine could not have written (engine/resume.py). A request that passes has
max_tokens held to max_model_len (engine/limits.py), so the scheduler never meets a sequence
longer than the cache.
"""
from __future__ import annotations

from genpool.engine import limits
from genpool.engine import resume as resume_mod
from genpool.engine.resume import ResumeState
from genpool.engine.sampling_params import SamplingParams


def encode_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """A string, {'prompt': str} or {'prompt_token_ids': [...]} -> (its text if known, its ids)."""
    if isinstance(prompt, str):
        return prompt, tokenizer(prompt)["input_ids"]
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return prompt.get("prompt"), list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return encode_prompt(tokenizer, prompt["prompt"])
    raise ValueError("prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]}")


def check_request(ids: list[int], params: SamplingParams, resume: ResumeState | None, *,
                  vocab_size: int, max_model_len: int, kv_capacity: int) -> SamplingParams:
    """ValueError for a request the engine cannot run; else its params, max_tokens capped.
    `kv_capacity`: the tokens the KV cache holds (it only words the too-long prompt's message)."""
    limits.check_prompt(ids, vocab_size, max_model_len, kv_capacity)
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got "
                         f"{max(params.logit_bias)}")
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got "
                         f"{max(params.stop_token_ids)}")
    params = limits.cap_max_tokens(params, len(ids), max_model_len)
    if resume is not None:
        resume_mod.check(resume, params, vocab_size)
    return params
