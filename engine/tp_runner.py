"""Model runners for tensor parallelism: rank 0's (`LeaderRunner`, in the engine) and the others'
(`follower_main`, each in its own process). docs/design.md "Tensor parallelism" has the picture.

Every rank runs ModelRunner.execute on the same scheduled batch: the same prepare() (so the same
block tables, slots and attention metadata everywhere), its shard of the weights and of the paged
KV cache, the all-reduces inside the model. Only rank 0 gets whole logits (the vocab gather) and
samples; the others drop theirs and wait for the next step.
"""
from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import traceback
from dataclasses import asdict, replace

import torch

from genpool.engine.config import EngineConfig, usable_cores
from genpool.engine.cpu_alloc import default_kv_budget
from genpool.engine.distributed import STOP, Comm, StepChannel, die, init_group, watch
from genpool.engine.model_runner import ModelRunner
from genpool.engine.models.loader import load_config
from genpool.engine.models.tp_linear import plan_shard
from genpool.engine.models.tp_loader import load_shard

log = logging.getLogger("genpool.tp")


def _rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """A rank's view: its own GPU; on the CPU its share of the worker's KV budget (the ranks share
    one host's memory, so N ranks hold kv_cache_memory in all, as one rank would)."""
    if config.device.startswith("cuda"):
        return replace(config, device=f"cuda:{rank}")
    total = config.kv_cache_memory
    if total is None:  # the single-process default's machine cap, shared out (engine/cpu_alloc.py)
        total = default_kv_budget(1 << 62)
    return replace(config, kv_cache_memory=max(1, total // config.tensor_parallel_size))


def _threads_per_rank(config: EngineConfig) -> int:
    """The worker's threads (num_threads, else every core it may run on: taskset and cpusets
    count) shared out: ranks must not oversubscribe."""
    return max(1, (config.num_threads or usable_cores()) // config.tensor_parallel_size)


class TPModelRunner(ModelRunner):
    """One rank's runner: its shard of the model and of every layer's KV cache."""

    def __init__(self, config: EngineConfig, model_path, max_model_len: int, comm: Comm,
                 startup=None):
        self.comm = comm
        if config.device == "cpu":
            torch.set_num_threads(_threads_per_rank(config))
        super().__init__(_rank_config(config, comm.rank), model_path, max_model_len, startup)

    def _blocks_from_budget(self) -> int:
        # GPUs may differ in free memory: every rank takes the least, agreed before any KV is
        # allocated (every rank comes here, or none: num_kv_blocks is the same on all)
        return self.comm.min_int(super()._blocks_from_budget())

    def _load_model(self, model_path):
        return load_shard(model_path, self.comm.rank, self.comm.size, self.comm, self.dtype, self.device,
                          self.kern)


START_GRACE_S = 30.0  # after a rank died while starting, how long rank 0 may take to fail too


class LeaderRunner(TPModelRunner):
    """Rank 0: spawns and watches ranks 1..N-1, broadcasts each step before running it."""

    _active: "LeaderRunner | None" = None  # one process group per process
    owner = staticmethod(lambda: True)  # LLMEngine sets a weakref to itself: gone -> closable

    def __init__(self, config: EngineConfig, model_path, max_model_len: int, startup=None):
        LeaderRunner._close_orphan()
        if LeaderRunner._active is not None:
            raise RuntimeError("a tensor-parallel engine is already running in this process; close it "
                               "first (LLM.close(), or `with LLM(...) as llm:`)")
        size = config.tensor_parallel_size
        args, _ = load_config(model_path)
        plan_shard(args, 0, size)  # unsupported splits: a clear error before any process starts
        self._stopping = threading.Event()
        self._ready = threading.Event()  # started: from here a rank's death ends the process
        self._start_death: str | None = None
        self._tmp = tempfile.mkdtemp(prefix="genpool-tp-")
        init = f"file://{self._tmp}/rendezvous"
        ctx = multiprocessing.get_context("spawn")
        self.procs = {r: ctx.Process(target=follower_main, name=f"genpool-tp-rank{r}", daemon=True,
                                     args=(asdict(config), str(model_path), max_model_len, r, init))
                      for r in range(1, size)}
        for p in self.procs.values():
            p.start()
        watch({r: p.sentinel for r, p in self.procs.items()}, self._rank_died, self._stopping)
        log.info("tensor parallel: rank 0 of %d (pid %d), ranks %s", size, os.getpid(),
                 {r: p.pid for r, p in self.procs.items()})
        try:
            comm = init_group(0, size, init, torch.device(_rank_config(config, 0).device))
            LeaderRunner._active = self
            super().__init__(config, model_path, max_model_len, comm, startup)
        except BaseException:  # e.g. a KV budget too small for one block: leave no rank behind
            self._abandon()
            raise
        self.channel = StepChannel(comm)
        self._ready.set()
        if self._start_death is not None:  # it died after its part of the start
            self._abandon()
            raise RuntimeError(self._start_death)
        atexit.register(self.close)

    @staticmethod
    def _close_orphan() -> None:
        """The running engine's LLM was deleted without close(): its ranks are nobody's, stop them
        (one process group per process, so a new engine needs them gone)."""
        active = LeaderRunner._active
        if active is not None and active.owner() is not None:
            gc.collect()  # the engine's own reference cycles keep it until a collection
        if active is not None and active.owner() is None:
            log.info("tensor parallel: closing the engine whose LLM was deleted")
            active.close()

    def _abandon(self) -> None:
        self._stopping.set()
        for p in self.procs.values():
            p.kill()
            p.join()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        shutil.rmtree(self._tmp, ignore_errors=True)
        LeaderRunner._active = None

    def _rank_died(self, rank: int) -> None:
        p = self.procs[rank]
        p.join(0.1)
        for other in self.procs.values():
            if other.is_alive():
                other.kill()
        if not self._ready.is_set():
            # While starting, every rank usually fails the same way (e.g. a KV budget that holds
            # no block) and rank 0's own error is the one to raise: let it, rather than end the
            # caller's process. A rank 0 stuck in a collective still exits, after START_GRACE_S.
            self._start_death = f"tensor-parallel rank {rank} (pid {p.pid}) died while starting " \
                                f"(exit code {p.exitcode}); see its log above"
            timer = threading.Timer(START_GRACE_S, self._start_stuck)
            timer.daemon = True
            timer.start()
            return
        self._die(f"tensor-parallel rank {rank} (pid {p.pid}) died (exit code {p.exitcode}): the worker exits "
            f"now; its unfinished jobs will be reclaimed by other workers")

    def _die(self, message: str) -> None:
        shutil.rmtree(self._tmp, ignore_errors=True)  # the exit skips close(): leave no rendezvous behind
        die(message)

    def _start_stuck(self) -> None:
        if not self._ready.is_set() and not self._stopping.is_set():
            self._die(f"{self._start_death}; rank 0 is still waiting for it: the process exits")

    def execute(self, scheduled, copies):
        try:
            self.channel.send_step(scheduled, copies)
            return super().execute(scheduled, copies)
        except Exception:  # the ranks may now disagree about where they are: stop them all
            self._die(f"tensor-parallel step failed on rank 0; the worker exits:\n{traceback.format_exc()}")

    def close(self) -> None:
        """Stop ranks 1..N-1 and leave the process group (idempotent; also runs at exit)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        try:
            self.channel.send_stop()
        except Exception as e:  # a rank already gone: the joins below still reap the rest
            log.warning("tensor parallel: stop broadcast failed: %s", e)
        for p in self.procs.values():
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        torch.distributed.destroy_process_group()
        shutil.rmtree(self._tmp, ignore_errors=True)
        LeaderRunner._active = None
        atexit.unregister(self.close)
        super().close()


def follower_main(config: dict, model_path: str, max_model_len: int, rank: int, init: str) -> None:
    """Rank `rank`'s whole life: load the shard, then run every step rank 0 broadcasts until STOP."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank{rank}: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C reaches the whole process group: rank 0 drains,
        signal.signal(sig, signal.SIG_IGN)       # then stops us (STOP), or we follow it when it is gone
    cfg = EngineConfig(**config)
    stopping = threading.Event()
    parent = multiprocessing.parent_process()

    def leader_gone(_):  # a killed rank 0 cleans nothing: its rendezvous directory goes with us
        shutil.rmtree(os.path.dirname(init.removeprefix("file://")), ignore_errors=True)
        die(f"tensor-parallel rank {rank}: rank 0 (pid {parent.pid}) is gone; exiting")
    watch({0: parent.sentinel}, leader_gone, stopping)
    try:
        comm = init_group(rank, cfg.tensor_parallel_size, init, torch.device(_rank_config(cfg, rank).device))
        runner = TPModelRunner(cfg, model_path, max_model_len, comm)
        channel = StepChannel(comm)
        while True:
            op, scheduled, copies = channel.recv()
            if op == STOP:
                break
            runner.execute(scheduled, copies)
    except Exception:
        die(f"tensor-parallel rank {rank} failed:\n{traceback.format_exc()}")
    stopping.set()
    torch.distributed.destroy_process_group()
    logging.shutdown()
    os._exit(0)  # nothing left to tear down: skipping the interpreter's teardown saves seconds on busy cores
