"""HF transformers references for engine tests (fp32, one request at a time, cached per path)."""
from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=4)
def hf_model(model_path: str, dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=getattr(torch, dtype))
    return m.eval()


@torch.inference_mode()
def hf_greedy(model_path, prompt_token_ids_list, max_new_tokens: int, ignore_eos: bool = False,
              dtype: str = "float32") -> list[list[int]]:
    """Greedy continuations (generated ids only). Stops after the EOS token, which is included
    (as vLLM/genpool report it); with ignore_eos=True always runs max_new_tokens steps."""
    m = hf_model(str(model_path), dtype)
    eos = m.generation_config.eos_token_id
    outs = []
    for ids in prompt_token_ids_list:
        x = torch.tensor([list(ids)], dtype=torch.long)
        kw = dict(max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
                  top_k=None, attention_mask=torch.ones_like(x), pad_token_id=eos)
        if ignore_eos:
            gen = _manual_greedy(m, x, max_new_tokens)
        else:
            gen = m.generate(x, **kw)[0, x.shape[1]:].tolist()
        outs.append(gen)
    return outs


def _manual_greedy(m, x, n: int) -> list[int]:
    out = m(x, use_cache=True)
    toks = []
    for _ in range(n):
        t = int(out.logits[0, -1].argmax())
        toks.append(t)
        if len(toks) == n:
            break
        out = m(torch.tensor([[t]]), cache=_cache_of(out), use_cache=True)
    return toks


def _cache_of(out):
    return out["cache"] if "cache" in out else out.past_key_values  # transformers 5.24: "cache"


@torch.inference_mode()
def hf_logits(model_path, token_ids, dtype: str = "float32") -> torch.Tensor:
    """Logits [len(token_ids), vocab] (fp32) of one full forward over token_ids."""
    m = hf_model(str(model_path), dtype)
    return m(torch.tensor([list(token_ids)], dtype=torch.long)).logits[0].float()


def top2_gap(logits_row: torch.Tensor) -> float:
    """Difference between the best and second-best logit (near-tie check)."""
    v = torch.topk(logits_row.float(), 2).values
    return float(v[0] - v[1])
