"""`echo` and token-id prompts on /v1/completions, as OpenAI's legacy API had them and
lm-eval-harness uses them: `echo=True, logprobs=k, max_tokens=0` scores a prompt (each token's
logprob given what precedes it; the first token's is null) and generates nothing.

The gateway holds no tokenizer: the job asks the worker for the prompt's own logprobs
(JobRequest.prompt_logprobs) whenever the echo needs token-level detail (logprobs asked, a
token-id prompt whose text only the worker can decode, or max_tokens=0), and the result carries
them (PromptScores: ids, per-token maps, each id's text). An echo of a text prompt without
logprobs is the prompt string itself and costs the job nothing.
"""
from __future__ import annotations

from typing import Any, Optional

from genpool.schemas import JobResult
from genpool.schemas.events import PromptScores

from .openai_logprobs import completion as completion_logprobs


class EchoError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _is_ids(raw: Any) -> bool:
    return (isinstance(raw, list) and bool(raw)
            and all(isinstance(t, int) and not isinstance(t, bool) for t in raw))


def prompt_fields(raw: Any) -> dict:
    """A completions `prompt` -> the job's prompt field: a string, a one-string array, an array
    of token ids, or an array holding one such array. More than one prompt is refused (one
    request per prompt: each is a job)."""
    if isinstance(raw, list) and len(raw) == 1 and (isinstance(raw[0], str) or _is_ids(raw[0])):
        raw = raw[0]
    if isinstance(raw, str):
        return {"prompt": raw}
    if _is_ids(raw):
        return {"prompt_token_ids": raw}
    if raw is None:
        raise EchoError("prompt is required", "prompt")
    if isinstance(raw, list) and len(raw) > 1 and all(isinstance(p, (str, list)) for p in raw):
        raise EchoError(f"prompt holds {len(raw)} prompts: send one request per prompt", "prompt")
    raise EchoError("prompt must be a string, an array of token ids, or an array holding one "
                    "of them", "prompt")


def apply(body: dict, kw: dict, top: Optional[int]) -> bool:
    """Set the job's prompt_logprobs for `echo` (and check max_tokens=0, which only an echo may
    ask); returns whether the request echoes."""
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise EchoError(f"echo must be a boolean, got {echo!r}", "echo")
    extra = body.get("prompt_logprobs")  # vLLM's extension: the scores without the echo
    if extra is not None and body.get("stream") is True:
        # a stream's chunks have no field for them (vLLM refuses too); a streamed 0 asks for nothing
        if extra == 0 and not isinstance(extra, bool):
            extra = None
        else:
            raise EchoError("prompt_logprobs are not available when stream=true: a streamed response has "
                            "no field for them (send stream=false, or echo=true with logprobs)",
                            "prompt_logprobs")
    if extra is not None:
        kw["prompt_logprobs"] = extra
    if kw.get("max_tokens") == 0 and not echo and extra is None:
        raise EchoError("max_tokens 0 generates nothing: it needs echo (or prompt_logprobs)",
                        "max_tokens")
    if echo and (top is not None or "prompt_token_ids" in kw or kw.get("max_tokens") == 0):
        kw.setdefault("prompt_logprobs", top or 0)
    return bool(echo)


def text(prompt: Optional[str], scores: Optional[PromptScores]) -> str:
    """The echoed prompt: the string sent, or the token-id prompt decoded by the worker."""
    if prompt is not None:
        return prompt
    if scores is None:
        return ""
    if scores.text is not None:  # decoded whole by the worker
        return scores.text
    return "".join(scores.token_texts.get(str(t), "") for t in scores.token_ids)


def logprobs(scores: Optional[PromptScores], k: Optional[int]) -> Optional[dict]:
    """The prompt's part of a completions `logprobs` (null logprob and top for the first token)."""
    if k is None or scores is None:
        return None
    ids, texts = scores.token_ids, scores.token_texts
    maps = [d or {} for d in scores.logprobs]
    out = completion_logprobs(ids, maps, texts, k)
    out["token_logprobs"] = [None if d is None else d.get(str(t), float("-inf"))
                             for t, d in zip(ids, scores.logprobs)]
    out["top_logprobs"] = [None if d is None else top for d, top in zip(scores.logprobs,
                                                                        out["top_logprobs"])]
    return out


def vllm_prompt_logprobs(scores: Optional[PromptScores]) -> Optional[list]:
    """vLLM's `prompt_logprobs` field of a completions choice (its extension, asked without
    echo): null for the first token, then {token_id: {logprob, decoded_token}} per position."""
    if scores is None:
        return None
    texts = scores.token_texts
    return [None if d is None else {k: {"logprob": v, "decoded_token": texts.get(k, "")}
                                    for k, v in d.items()} for d in scores.logprobs]


def join(head: Optional[dict], tail: Optional[dict], head_len: int) -> Optional[dict]:
    """The prompt's logprobs, then the completion's (its text offsets moved past the prompt)."""
    if head is None or tail is None:
        return head if tail is None else tail
    return {"tokens": head["tokens"] + tail["tokens"],
            "token_logprobs": head["token_logprobs"] + tail["token_logprobs"],
            "top_logprobs": head["top_logprobs"] + tail["top_logprobs"],
            "text_offset": head["text_offset"] + [o + head_len for o in tail["text_offset"]]}


def choice(prompt: Optional[str], res: JobResult, k: Optional[int], text_: str,
           lps: Optional[dict]) -> tuple[str, Optional[dict]]:
    """One echoed choice's text and logprobs: the prompt's, then the completion's."""
    head_text = text(prompt, res.prompt)
    return head_text + text_, join(logprobs(res.prompt, k), lps, len(head_text))
