"""genpool's resident continuous-batching engine (vLLM-style API).

Importing it before torch bounds libgomp's spin for the process, as the genpool command does
(schemas/settings.py bound_openmp_spinning; an environment that names a policy keeps it)."""
from genpool.schemas.settings import bound_openmp_spinning

bound_openmp_spinning()  # before LLM imports torch: libgomp reads it once, when torch loads it

from genpool.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from genpool.engine.sampling_params import SamplingParams  # noqa: E402


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
