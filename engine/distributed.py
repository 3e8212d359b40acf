"""Tensor parallelism's process group: the collectives, the per-step broadcast, and the ranks' lives.

Rank 0 is the process that built the engine (the worker): it owns the scheduler, the sampler and
Redis. It spawns ranks 1..N-1 (multiprocessing "spawn"), which load their shards and then loop:
receive one step's metadata (one broadcast), run the same forward (all-reduces inside), repeat.
Liveness: a dead rank never leaves the others waiting in a collective. Rank 0's monitor thread
waits on every rank's process sentinel and each other rank's monitor waits on rank 0's; a death
logs one clear line and ends the whole worker at once (os._exit: a peer may be blocked inside
gloo, where no exception could reach it). The worker's unfinished jobs are then reclaimed by other
workers like any crashed worker's. Collective timeouts cannot do this job: a follower waits for
the next step as long as the worker is idle, which has no bound.
"""
from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger("genpool.tp")

EXIT_RANK_DIED = 3  # the worker's exit status when a tensor-parallel rank died
STOP, STEP, GROW = 0, 1, 2  # the step broadcast's opcodes


@dataclass
class CommStats:
    """Time inside collectives on this rank (rank 0's numbers include waiting for slower ranks)."""
    all_reduce_s: float = 0.0
    all_reduce_calls: int = 0
    broadcast_s: float = 0.0
    broadcasts: int = 0
    gather_s: float = 0.0


class Comm:
    """The collectives the model and runner use, timed."""

    def __init__(self, rank: int, size: int, device: torch.device):
        self.rank, self.size, self.device = rank, size, device
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        dist.all_reduce(x)
        self.stats.all_reduce_s += time.perf_counter() - t0
        self.stats.all_reduce_calls += 1
        return x

    def gather_to_first(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=0)
        self.stats.gather_s += time.perf_counter() - t0
        return parts

    def broadcast(self, buf: torch.Tensor) -> None:
        t0 = time.perf_counter()
        dist.broadcast(buf, src=0)
        self.stats.broadcast_s += time.perf_counter() - t0
        self.stats.broadcasts += 1

    def min_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())


def init_group(rank: int, size: int, init_method: str, device: torch.device) -> Comm:
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: keep gloo on loopback
    # Long timeout on purpose: followers wait for the next step for as long as the worker is idle;
    # liveness is the monitors' job (module docstring).
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=timedelta(days=365))
    return Comm(rank, size, device)


class StepChannel:
    """One broadcast per step: rank 0 packs the step into a fixed-capacity int64 buffer and
    broadcasts it; the others unpack the same numbers. A step that does not fit first sends a GROW
    header (both sides enlarge the buffer for good), so steady state is one broadcast per step."""

    HEADER = 4  # opcode, number of sequences, number of block copies, payload length

    def __init__(self, comm: Comm, capacity: int = 4096):
        self.comm = comm
        self.buf = torch.zeros(capacity, dtype=torch.int64, device=comm.device)

    def _send(self, payload: list[int]) -> None:
        if len(payload) > self.buf.numel():
            cap = max(len(payload), 2 * self.buf.numel())
            self.buf[:2] = torch.tensor([GROW, cap])
            self.comm.broadcast(self.buf)
            self.buf = torch.zeros(cap, dtype=torch.int64, device=self.comm.device)
        self.buf[:len(payload)] = torch.tensor(payload, dtype=torch.int64)
        self.comm.broadcast(self.buf)

    def send_step(self, scheduled, copies: list[tuple[int, int]]) -> None:
        payload = [STEP, len(scheduled), len(copies), 0]
        for src, dst in copies:
            payload += (src, dst)
        for seq, n in scheduled:
            start, table = seq.num_computed_tokens, seq.block_table
            score = seq.prompt_score_rows(n)  # the rows kept must agree on every rank
            payload += (start, n, seq.num_tokens, len(table), score.start, score.stop)
            payload += seq.step_token_ids(n)
            payload += table
        payload[3] = len(payload)
        self._send(payload)

    def send_stop(self) -> None:
        self._send([STOP, 0, 0, self.HEADER])

    def recv(self) -> tuple[int, list["StepSeq"], list[tuple[int, int]]]:
        """(opcode, scheduled, copies) of rank 0's next message."""
        while True:
            self.comm.broadcast(self.buf)
            if int(self.buf[0]) != GROW:
                break
            self.buf = torch.zeros(int(self.buf[1]), dtype=torch.int64, device=self.comm.device)
        head = self.buf[:self.HEADER].tolist()
        vals = self.buf[:head[3]].tolist()
        i = self.HEADER
        copies = [(vals[i + 2 * k], vals[i + 2 * k + 1]) for k in range(head[2])]
        i += 2 * head[2]
        scheduled = []
        for _ in range(head[1]):
            start, n, num_tokens, width, lo, hi = vals[i:i + 6]
            i += 6
            seq = StepSeq(start, num_tokens, vals[i:i + n], vals[i + n:i + n + width], range(lo, hi))
            i += n + width
            scheduled.append((seq, n))
        return head[0], scheduled, copies


@dataclass
class StepSeq:
    """What ModelRunner.prepare reads of a Sequence, rebuilt on ranks 1..N-1 from the broadcast."""
    num_computed_tokens: int
    num_tokens: int
    new_tokens: list[int]
    block_table: list[int]
    score_rows: range = range(0)  # Sequence.prompt_score_rows of this step, as rank 0 found it

    def prompt_score_rows(self, n: int) -> range:
        return self.score_rows

    def step_token_ids(self, n: int) -> list[int]:
        return self.new_tokens


def die(message: str) -> None:
    """End this process now with one clear log line (see the module docstring for why os._exit)."""
    log.critical(message)
    for h in logging.getLogger().handlers + log.handlers:
        h.flush()
    os._exit(EXIT_RANK_DIED)


def watch(sentinels: dict[int, int], on_death, stopping: threading.Event) -> threading.Thread:
    """A daemon thread calling on_death(rank) when the first of the processes behind `sentinels`
    ({rank: sentinel}) ends while `stopping` is not set."""
    def run():
        ready = multiprocessing.connection.wait(list(sentinels.values()))
        if not stopping.is_set():
            rank = next(r for r, s in sentinels.items() if s in ready)
            on_death(rank)

    t = threading.Thread(target=run, name="tp-monitor", daemon=True)
    t.start()
    return t
