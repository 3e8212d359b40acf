"""The model runner's last-layer pruning: in a step where only some rows are sampled (a prompt's
last token, not its other tokens or a chunk that ends mid-prompt), the last layer runs attention,
o_proj and the MLP on the sampled rows alone. Their logits must match running every row, and every
row's K/V must still reach the cache (later steps attend to them)."""
from types import SimpleNamespace

import torch

from genpool.engine.config import EngineConfig
from genpool.engine.model_runner import ModelRunner


def _seq(tokens, computed, table):
    return SimpleNamespace(token_ids=tokens, num_computed_tokens=computed, num_tokens=len(tokens), block_table=table,
                           prompt_score_rows=lambda n: range(0),
                           step_token_ids=lambda n: tokens[computed:computed + n])


def test_last_layer_runs_only_the_sampled_rows(tiny_llama_path):
    runner = ModelRunner(EngineConfig(model=str(tiny_llama_path), num_kv_blocks=16), tiny_llama_path, 256)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, 1000, (n,), generator=g).tolist() for n in (20, 40, 5))
    # a: a whole prompt; b: its first 16 tokens only (no sampled row); c: a whole prompt
    scheduled = [(_seq(a, 0, [0, 1]), 20), (_seq(b, 0, [2, 3, 4]), 16), (_seq(c, 0, [5]), 5)]
    rows_seen = []
    last_mlp = runner.model.model.layers[-1].mlp
    hook = last_mlp.register_forward_pre_hook(lambda m, args: rows_seen.append(args[0].shape[0]))
    pruned = runner.execute(scheduled, [])
    caches = [t.clone() for kv in runner.kv_caches for t in kv]
    hook.remove()
    assert rows_seen == [2]  # the last layer's MLP ran on the two sampled rows, not on 41

    ids, pos, meta, logit_rows = runner.prepare(scheduled)
    assert logit_rows == [19, 40] and meta.keep.rows.tolist() == [19, 40]
    meta.keep = None  # every row through every layer, then the sampled rows picked out
    with torch.inference_mode():
        hidden = runner.model(ids, pos, runner.kv_caches, meta)
        full = runner.model.compute_logits(hidden.index_select(0, torch.tensor(logit_rows)))
    torch.testing.assert_close(pruned, full, rtol=1e-5, atol=1e-5)
    assert pruned.argmax(-1).tolist() == full.argmax(-1).tolist()
    # the unpruned run rewrote every slot with the same K/V: the pruned run had written them all
    assert all(torch.equal(x, t) for x, t in zip(caches, (t for kv in runner.kv_caches for t in kv)))


def test_a_pure_decode_step_is_not_pruned(tiny_llama_path):
    runner = ModelRunner(EngineConfig(model=str(tiny_llama_path), num_kv_blocks=8), tiny_llama_path, 256)
    runner.execute([(_seq(list(range(3, 13)), 0, [0]), 10)], [])
    _, _, meta, rows = runner.prepare([(_seq(list(range(3, 14)), 10, [0]), 1)])
    assert rows == [0] and meta.keep is None


def test_a_step_with_no_sampled_row_stops_after_the_last_kv_write(tiny_llama_path):
    """A chunk that ends mid-prompt samples nothing: the last layer writes its K/V (later chunks
    attend to them) and runs nothing after; the next chunk's logits match a whole-prompt run."""
    cfg = EngineConfig(model=str(tiny_llama_path), num_kv_blocks=8)
    runner = ModelRunner(cfg, tiny_llama_path, 256)
    tokens = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    rows_seen = []
    hook = runner.model.model.layers[-1].mlp.register_forward_pre_hook(lambda m, a: rows_seen.append(a[0].shape[0]))
    first = runner.execute([(_seq(tokens, 0, [0, 1, 2]), 24)], [])  # positions 0-23: nothing sampled
    hook.remove()
    assert first.shape == (0, runner.args.vocab_size) and rows_seen == []
    chunked = runner.execute([(_seq(tokens, 24, [0, 1, 2]), 16)], [])
    whole = ModelRunner(cfg, tiny_llama_path, 256).execute([(_seq(tokens, 0, [0, 1, 2]), 40)], [])
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
