"""genpool's resident continuous-batching engine (vLLM-style API)."""
from genpool.engine.outputs import CompletionOutput, RequestOutput
from genpool.engine.sampling_params import SamplingParams


def __getattr__(name):
    # LLM / LLMEngine pull in torch + the model stack: import them only when asked for.
    if name == "LLM":
        from genpool.engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from genpool.engine.llm_engine import LLMEngine
        return LLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
