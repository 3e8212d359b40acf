"""The whole engine on the Triton kernel backend (not only the kernels one by one): on the CPU the
kernels run under Triton's interpreter (TRITON_INTERPRET=1, ~1 ms per program instance), so the model
is the tiny one and the requests are short. Its greedy tokens must equal the torch reference
backend's, across a prompt step, decode steps and a prefix-cache hit."""
from tests.triton_interp import DEVICE  # noqa: I001 (first: sets TRITON_INTERPRET=1 on the CPU)

import torch  # noqa: E402

from genpool.engine import LLM, SamplingParams  # noqa: E402

PROMPTS = [{"prompt_token_ids": list(range(5, 26))},  # 21 tokens: two blocks, the second partial
           {"prompt_token_ids": list(range(5, 21)) + [400, 401, 402]}]  # shares the first block


def _run(path, backend: str):
    llm = LLM(str(path), kernel_backend=backend, device=DEVICE, num_kv_blocks=16, max_num_seqs=4)
    assert llm.llm_engine.runner.kern.name == backend
    first = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    # the second prompt arrives once the first is cached: its first block comes from the cache
    both = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert llm.llm_engine.stats().prefix_cache_hits >= 16
    return [o.outputs[0].token_ids for o in first + both]


def test_triton_engine_matches_the_torch_reference(tiny_llama_path):
    torch.manual_seed(0)
    want = _run(tiny_llama_path, "torch")
    got = _run(tiny_llama_path, "triton")
    assert got == want and all(len(t) == 4 for t in got)
