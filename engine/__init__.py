"""genpool's resident continuous-batching engine (vLLM-style API)."""
from engine.sampling_params import SamplingParams
from engine.outputs import CompletionOutput, RequestOutput


def __getattr__(name):
    # LLM / LLMEngine pull in torch + the model stack: import them only when asked for.
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
