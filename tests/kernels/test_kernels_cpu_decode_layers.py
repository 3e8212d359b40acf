"""kernels/cpu/cpu_decode_layers.c: a pure-decode step's decoder stack in one C call must give the bits
of the module path (the same CPU kernels launched one by one from Python), write the same K/V, and
decline (None) what it cannot run, so that the model keeps its module path there."""
from types import SimpleNamespace

import pytest
import torch

from genpool.engine.config import EngineConfig
from genpool.engine.model_runner import ModelRunner
from genpool.kernels.cpu import decode_layers as cpu_decode_layers

pytestmark = pytest.mark.skipif(not cpu_decode_layers.available(), reason="no C compiler for the CPU kernels")


def _seq(tokens, computed, table):
    return SimpleNamespace(token_ids=tokens, num_computed_tokens=computed, num_tokens=len(tokens), block_table=table,
                           prompt_score_rows=lambda n: range(0),
                           step_token_ids=lambda n: tokens[computed:computed + n])


def _runner(path, blocks=32, kv_cache_dtype="auto"):
    runner = ModelRunner(EngineConfig(model=str(path), num_kv_blocks=blocks, kv_cache_dtype=kv_cache_dtype), path, 256)
    assert runner.kern.name == "cpu" and runner.decode_stack is not None
    return runner


def _prefilled(runner, lens, seed=0):
    """Sequences of these prompt lengths with their prompts' K/V in the cache, block tables disjoint."""
    g, seqs, nxt = torch.Generator().manual_seed(seed), [], 0
    for n in lens:
        nb = (n + 1 + 15) // 16 + 1  # room for a few decode tokens
        seqs.append(_seq(torch.randint(3, 1000, (n,), generator=g).tolist(), 0, list(range(nxt, nxt + nb))))
        nxt += nb
    runner.execute([(s, len(s.token_ids)) for s in seqs], [])
    for s in seqs:
        s.num_computed_tokens = len(s.token_ids)
    return seqs


def _both_paths(runner, scheduled):
    """The step's hidden states and caches through the C stack, then through the modules (from the
    same caches); the stack must have run without entering a layer module."""
    ids, pos, meta, _ = runner.prepare(scheduled)
    assert meta.decode_only
    before = [t.clone() for kv in runner.kv_caches for t in kv]
    entered = []
    hook = runner.model.model.layers[0].register_forward_pre_hook(lambda m, a: entered.append(1))
    with torch.inference_mode():
        fused = runner.model(ids, pos, runner.kv_caches, meta, runner.decode_stack)
        fused_caches = [t.clone() for kv in runner.kv_caches for t in kv]
        assert entered == []
        for t, b in zip((t for kv in runner.kv_caches for t in kv), before):
            t.copy_(b)
        meta.decode_only = False
        modules = runner.model(ids, pos, runner.kv_caches, meta, runner.decode_stack)
    hook.remove()
    assert entered == [1]
    return fused, modules, fused_caches, [t for kv in runner.kv_caches for t in kv]


def _decode_steps_match(runner, seqs, steps=3):
    for step in range(steps):
        for s in seqs:
            s.token_ids.append(3 + 7 * step + len(s.token_ids))
            s.num_tokens += 1
        scheduled = [(s, 1) for s in seqs]
        fused, modules, fused_caches, module_caches = _both_paths(runner, scheduled)
        assert fused.shape == (len(seqs), runner.args.hidden_size)
        assert torch.equal(fused, modules)
        assert all(torch.equal(a, b) for a, b in zip(fused_caches, module_caches))
        for s in seqs:
            s.num_computed_tokens += 1


@pytest.mark.parametrize("kv", ["auto", "bfloat16", "int8"])
@pytest.mark.parametrize("fixture", ["tiny_llama_path", "tiny_qwen2_path"])
def test_the_stack_gives_the_module_paths_bits(fixture, kv, request):
    """bfloat16 / int8: a bf16 or int8 KV cache under the fp32 model, written rounded (quantized)
    and read widened on both paths."""
    runner = _runner(request.getfixturevalue(fixture), kv_cache_dtype=kv)
    assert runner.kv_caches[0][0].dtype == {"bfloat16": torch.bfloat16, "int8": torch.int8}.get(kv, torch.float32)
    assert runner.decode_stack is not None
    # the 16-token one starts a new block at the first step, the 47-token one at the second
    _decode_steps_match(runner, _prefilled(runner, [5, 16, 31, 47]))


def test_the_stack_gives_the_module_paths_bits_on_two_threads(tiny_llama_path):
    """48 rows: enough work that the GEMMs split their panels between two threads (so each thread
    prefetches its share of the next product) and attention its rows."""
    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread")
    runner = _runner(tiny_llama_path, blocks=300)
    lens = torch.randint(30, 80, (48,), generator=torch.Generator().manual_seed(3)).tolist()
    _decode_steps_match(runner, _prefilled(runner, lens, seed=3), steps=2)


def test_a_step_with_a_prompt_chunk_keeps_the_module_path(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    seqs = _prefilled(runner, [9])
    seqs[0].token_ids.append(5)
    seqs[0].num_tokens += 1
    fresh = _seq(list(range(3, 23)), 0, [20, 21])
    _, _, meta, _ = runner.prepare([(seqs[0], 1), (fresh, 20)])
    assert not meta.decode_only
    _, _, meta, _ = runner.prepare([(fresh, 1)])  # one token of a prompt, not its last: nothing sampled
    assert not meta.decode_only


def _stack_inputs(runner):
    return runner.model.decode_stack_spec(runner.kv_caches, runner.rope.shape[0])


def test_build_declines_what_the_stack_cannot_run(tiny_llama_path):
    runner = _runner(tiny_llama_path)
    layers, norm, kw = _stack_inputs(runner)
    assert cpu_decode_layers.build(layers, norm, **kw) is not None
    half = [dict(lay, k_cache=lay["k_cache"].half(), v_cache=lay["v_cache"].half()) for lay in layers]
    assert cpu_decode_layers.build(half, norm, **kw) is None  # fp16 caches: the stack reads fp32 or bf16
    mixed = [dict(lay, v_cache=lay["v_cache"].bfloat16()) for lay in layers]
    assert cpu_decode_layers.build(mixed, norm, **kw) is None  # K and V of different dtypes
    unpacked = [dict(lay, o=(torch.zeros(64, 64), None)) for lay in layers]  # the torch backend's layout
    assert cpu_decode_layers.build(unpacked, norm, **kw) is None
    biased = cpu_decode_layers.cpu_gemm.PackedWeight(torch.zeros(64, 64), torch.ones(64))
    assert cpu_decode_layers.build([dict(lay, o=biased) for lay in layers], norm, **kw) is None
    unfused = cpu_decode_layers.cpu_gemm.PackedWeight(torch.zeros(64, 2 * 128))  # the right shape, but
    unfused.__dict__["swiglu_fusable"] = False  # as for an I that is not whole panels
    assert cpu_decode_layers.build([dict(lay, gate_up=unfused) for lay in layers], norm, **kw) is None
    assert cpu_decode_layers.build(layers, norm, **kw) is not None  # the real layers still build
    assert cpu_decode_layers.build([], norm, **kw) is None


def test_bad_metadata_is_a_clear_error(tiny_llama_path):
    runner = _runner(tiny_llama_path, blocks=8)
    layers, norm, kw = _stack_inputs(runner)
    stack = cpu_decode_layers.build(layers, norm, **kw)
    x = torch.randn(2, 64)
    pos, slots = torch.tensor([3, 4]), torch.tensor([3, 20])
    tables, lens = torch.tensor([[0], [1]], dtype=torch.int32), torch.tensor([4, 5], dtype=torch.int32)
    assert stack(x, pos, runner.rope, slots, tables, lens).shape == (2, 64)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        stack(x, torch.tensor([3, 256]), runner.rope, slots, tables, lens)
    with pytest.raises(RuntimeError, match="slot lies outside the KV cache"):
        stack(x, pos, runner.rope, torch.tensor([3, 8 * 16]), tables, lens)
    with pytest.raises(RuntimeError, match="block id lies outside"):
        stack(x, pos, runner.rope, slots, torch.tensor([[0], [9]], dtype=torch.int32), lens)
    with pytest.raises(ValueError, match="metadata for 2 rows"):
        stack(x, pos[:1], runner.rope, slots, tables, lens)
    with pytest.raises(ValueError, match="float32"):
        stack(x.double(), pos, runner.rope, slots, tables, lens)


def test_the_stack_is_built_where_the_caches_are_made(tiny_llama_path):
    runner = _runner(tiny_llama_path, blocks=8)
    first = runner.decode_stack
    assert first.layers[0].k_cache == runner.kv_caches[0][0].data_ptr()
    other = _runner(tiny_llama_path, blocks=8)  # a second runner: its own caches, its own stack
    assert other.decode_stack is not first
    assert other.decode_stack.layers[0].k_cache == other.kv_caches[0][0].data_ptr() != first.layers[0].k_cache
