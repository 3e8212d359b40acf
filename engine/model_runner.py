"""Runs one scheduled step: flattens the batch, owns the paged KV tensors, returns logits.

The batch is one flat token sequence (no padding): prefill chunks and decode tokens of many
sequences side by side. Attention metadata says which rows belong to whom and where each
token's K/V lives (slot = block_id * block_size + offset).
"""
from __future__ import annotations

import logging

import torch

from genpool.engine.attention_metadata import AttentionMetadata, SampledRows
from genpool.engine.config import EngineConfig, apply_kernel_settings
from genpool.engine.cpu_alloc import default_kv_budget, lazy_zeros, trim_heap, tune_malloc
from genpool.engine.models.llama import rope_cache
from genpool.engine.models.loader import load_model
from genpool.engine.startup import StartLog, mib
from genpool.engine.step_rows import row_layout
from genpool.kernels import get_backend, kvq
from genpool.schemas.settings import openmp_spin_unbounded

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path, max_model_len: int,
                 startup: StartLog | None = None):
        self.config = config
        startup = startup or StartLog()
        self.device = torch.device(config.resolved_device())
        apply_kernel_settings(config)  # before any kernel runs: the config's values, not the env's
        if self.device.type == "cpu":
            tune_malloc(config.malloc_tune)
            if openmp_spin_unbounded():
                log.warning("torch was imported before genpool.engine with no OpenMP wait policy set: its threads "
                            "spin ~300,000 times after each op and take cores from the kernels (decode steps "
                            "~10% slower measured); import genpool.engine first or set GOMP_SPINCOUNT=1000")
        self.dtype = config.torch_dtype
        self.kv_dtype = config.kv_torch_dtype  # the model's, or bf16 / int8 under fp32 (1/2, ~1/4 of the bytes)
        self.block_size = config.block_size
        self.kern = get_backend(config.kernel_backend, self.device.type)
        if self.kv_dtype != self.dtype and self.kern.name not in ("cpu", "torch"):
            raise ValueError(f"kv_cache_dtype {config.kv_cache_dtype} under a {config.dtype} model runs on the cpu "
                             f"and torch kernel backends, not {self.kern.name}")
        self.model = self._load_model(model_path)
        self.args = self.model.args
        startup.phase("weights loaded", f"{mib(param_bytes(self.model))} {self.dtype}")
        self.rope = rope_cache(self.args, max_model_len).to(self.device)
        startup.phase("kernels built", f"backend {self.kern.name}, weights packed")
        if self.device.type == "cpu":
            trim_heap()  # the loaded copies the packing replaced go back to the system
        self.max_model_len = max_model_len
        self.num_blocks = config.num_kv_blocks or self._blocks_from_budget()
        shape = (self.num_blocks, self.block_size, self.args.num_kv_heads, self.kv_row)
        self.kv_caches = [(self._kv_tensor(shape), self._kv_tensor(shape))
                          for _ in range(self.args.num_layers)]
        startup.phase("KV allocated", f"{self.num_blocks} blocks of {self.block_size} tokens, "
                      f"{mib(self.num_blocks * self.bytes_per_block)} {self.kv_dtype} reserved")
        # the backend's one-call stack for pure-decode steps (None where it has none), bound to these caches
        self.decode_stack = self.model.build_decode_stack(self.kv_caches, self.rope.shape[0])

    def close(self) -> None:
        """Drop the weights and the KV cache (their memory goes back once nothing else holds them)."""
        self.decode_stack = None
        self.kv_caches = []
        self.model = None
        if self.device.type == "cpu":
            trim_heap()
        elif self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _load_model(self, model_path):
        return load_model(model_path, self.dtype, self.device, self.kern, self.config.quantization)  # (a tensor-parallel rank loads its shard)

    @property
    def bytes_per_block(self) -> int:
        a = self.args
        return 2 * a.num_layers * self.block_size * a.num_kv_heads * self.kv_row * self.kv_dtype.itemsize

    @property
    def kv_row(self) -> int:
        """A cache vector's elements: head_dim, plus an int8 vector's scale bytes (kernels/kvq.py)."""
        return kvq.row_dim(self.args.head_dim, self.kv_dtype)

    def _kv_tensor(self, shape: tuple) -> torch.Tensor:
        if self.device.type == "cpu":
            return lazy_zeros(shape, self.kv_dtype)
        return torch.zeros(shape, dtype=self.kv_dtype, device=self.device)

    def _blocks_from_budget(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.gpu_memory_utilization) - used - (1 << 30)  # activations
        elif self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        else:
            per_seq = -(-self.max_model_len // self.block_size)
            budget = default_kv_budget(self.config.max_num_seqs * per_seq * self.bytes_per_block)
        blocks = budget // self.bytes_per_block
        if blocks < 1:
            raise ValueError(f"KV memory budget {budget} bytes holds no {self.bytes_per_block}-byte block")
        return int(blocks)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate shared partial blocks before anyone writes into them."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    def prepare(self, scheduled) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """scheduled: [(seq, num_new)] -> input ids [T], positions [T], attention meta, and the
        flat rows the model returns: each sampled sequence's last row, and more trailing rows
        of one that scores its prompt or verifies a draft (engine/step_rows.py).
        meta.keep: the last layer's attention meta for those rows alone (no rows when nothing is
        kept this step), or None when every row is kept (see LlamaForCausalLM.forward)."""
        bs = self.block_size
        ids, pos, slots, qsl, lens, tables = [], [], [], [0], [], []
        keep_rows, keep_qsl, keep_seqs, all_sampled = [], [0], [], True
        for i, (seq, n) in enumerate(scheduled):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            ids.extend(seq.step_token_ids(n))
            pos.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(qsl[-1] + n)
            lens.append(end)
            tables.append(table)
            _, sampled, kept = row_layout(seq, n)
            all_sampled &= sampled == n
            if kept:
                keep_rows.extend(range(qsl[-1] - kept, qsl[-1]))
                keep_qsl.append(keep_qsl[-1] + kept)
                keep_seqs.append(i)
        # Every row sampled (decodes, draft verifications: 1 + k rows a sequence): each row becomes
        # one query over its own prefix, so the step runs as decode rows (the one-call decode stack
        # on the CPU). Its K/V are all written before any row attends, and prefill attention gives
        # decode attention's bits row for row, so the results do not change; the step gets faster.
        # Prompt chunks keep prefill attention, which reads a sequence's K/V once, not once a row.
        if all_sampled:
            tables = [t for t, (_, n) in zip(tables, scheduled) for _ in range(n)]
            lens, qsl = [p + 1 for p in pos], list(range(len(ids) + 1))
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            rope=self.rope,
            decode_only=all_sampled,
        )
        if len(keep_rows) < len(ids):
            sel = torch.tensor(keep_seqs, dtype=torch.long, device=dev)
            meta.keep = SampledRows(
                rows=torch.tensor(keep_rows, dtype=torch.long, device=dev), block_tables=meta.block_tables.index_select(0, sel),
                query_start_loc=torch.tensor(keep_qsl, dtype=torch.int32, device=dev),
                seq_lens=meta.seq_lens.index_select(0, sel))
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(pos, dtype=torch.long, device=dev), meta, keep_rows)

    @torch.inference_mode()
    def execute(self, scheduled, copies: list[tuple[int, int]]) -> torch.Tensor:
        """One forward over the flattened batch -> fp32 logits [kept rows, V] (on CPU), in the
        order engine/step_rows.py's row_layout gives: one per sampling sequence, plus the prompt
        rows of a sequence that scores its prompt and the draft rows of one that verifies."""
        self.copy_blocks(copies)
        input_ids, positions, meta, rows = self.prepare(scheduled)
        kept = len(rows)
        # meta.keep None: every row is kept, so hidden's rows are already the logit rows;
        # otherwise the model returned the kept rows alone
        hidden = self.model(input_ids, positions, self.kv_caches, meta, self.decode_stack)
        if hidden.shape[0] != kept:  # a model that ignored meta.keep: never pair wrong rows
            raise RuntimeError(f"model returned {hidden.shape[0]} rows for {kept} kept ones")
        if not kept:
            return torch.empty(0, self.args.vocab_size)
        return self.model.compute_logits(hidden).cpu()


def param_bytes(model: torch.nn.Module) -> int:
    """Bytes the model's loaded tensors hold (packed copies live with the kernel backend)."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
