"""LLM: the offline entry point (vLLM's name and shape): generate / chat over a resident engine."""
from __future__ import annotations

from genpool.engine.config import EngineConfig
from genpool.engine.llm_engine import LLMEngine
from genpool.engine.outputs import RequestOutput
from genpool.engine.sampling_params import SamplingParams

# vLLM's speculative_config keys -> EngineConfig fields
SPEC_KEYS = {"method": "speculative_method", "num_speculative_tokens": "num_speculative_tokens",
             "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max",
             "disable_by_batch_size": "speculative_max_batch"}


def speculative_fields(spec: dict) -> dict:
    """vLLM's speculative_config as EngineConfig fields (their values are checked there)."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict like {{'method': 'ngram', "
                         f"'num_speculative_tokens': 4}}, got {spec!r}")
    if spec and spec.get("method") is None:  # vLLM refuses it too
        raise ValueError("speculative_config needs a method: {'method': 'ngram', ...}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)} (known: "
                         f"{', '.join(SPEC_KEYS)})")
    return {SPEC_KEYS[k]: v for k, v in spec.items()}


class LLM:
    def __init__(self, model: str, speculative_config: dict | None = None, **kwargs):
        """`speculative_config`: vLLM's, e.g. {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}."""
        kwargs.update(speculative_fields({} if speculative_config is None else speculative_config))
        self.llm_engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._counter = 0

    def close(self) -> None:
        """Free the engine now (ranks stopped, KV freed) rather than at exit; idempotent."""
        self.llm_engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        eng = self.llm_engine
        ids = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            rid = f"llm-{self._counter}"
            self._counter += 1
            eng.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
            ids.append(rid)
        reqs = {rid: eng.requests[rid] for rid in ids}
        while eng.has_unfinished_requests():
            eng.step()
        return [reqs[rid].full_output() for rid in ids]

    def chat(self, messages, sampling_params=None) -> list[RequestOutput]:
        """messages: one conversation (list of {role, content}) or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.llm_engine.tokenizer(
            self.llm_engine.apply_chat_template(c), add_special_tokens=False)["input_ids"]}
            for c in convs]
        return self.generate(prompts, sampling_params)
