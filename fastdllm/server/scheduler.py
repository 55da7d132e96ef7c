"""The bounded queue and the one inference thread that batches compatible jobs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ..generate import GenerationConfig, stream_blocks
from .schema import APIError

log = logging.getLogger("fastdllm.server")


# ---- the queue and the inference worker ---------------------------------------------------------
class QueueFull(Exception):
    pass


@dataclass(eq=False)
class Job:
    """One request: its rows (prompt x choice) with their seeds, decoded under one config."""

    prompts: list[list[int]]
    seeds: list[int]
    config: GenerationConfig  # seed=None: the seeds are per row
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away
    satisfied: bool = False  # the consumer needs no more blocks (every choice final)
    started: bool = False

    @property
    def rows(self) -> int:
        return len(self.prompts)

    @property
    def wanted(self) -> bool:
        return not (self.cancelled or self.satisfied)

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass


class Scheduler:
    """One bounded FIFO queue of jobs, served by one inference thread that batches equal configs."""

    def __init__(self, model, max_batch_size: int = 8, max_queue: int = 64, batch_wait: float = 0.0,
                 block_hook: Callable[[int], None] | None = None):
        self.model = model
        self.block_hook = block_hook  # called in the worker after each block (tests, diagnostics)
        self.batch_hook: Callable[[int, int], None] | None = None  # (rows, forward passes) after each batch
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch_wait = batch_wait
        self.cond = threading.Condition()
        self.pending: deque[Job] = deque()
        self.paused = False
        self.closing = False
        self.running_jobs = 0
        self.stats = dict(requests=0, rejected=0, completed=0, cancelled=0, errors=0, batches=0, batched_requests=0,
                          max_batch_rows=0, max_batch_requests=0, rows=0, blocks=0, stopped_early=0)
        self.thread = threading.Thread(target=self._loop, name="fastdllm-inference", daemon=True)
        self.thread.start()

    # -- called from the event loop
    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise QueueFull("the server is shutting down")
            if len(self.pending) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFull(f"the server is busy: {len(self.pending)} requests are queued (--max-queue "
                                f"{self.max_queue}); retry later")
            self.pending.append(job)
            self.stats["requests"] += 1
            self.cond.notify_all()

    def cancel(self, job: Job) -> None:
        with self.cond:
            if job.cancelled:
                return
            job.cancelled = True
            self.stats["cancelled"] += 1
            if job in self.pending:
                self.pending.remove(job)
                self.cond.notify_all()

    def pause(self) -> None:
        """Hold the worker before its next batch (for tests and maintenance)."""
        with self.cond:
            self.paused = True

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    def snapshot(self) -> dict:
        with self.cond:
            return {"queued": len(self.pending), "running": self.running_jobs, "max_batch_size": self.max_batch_size,
                    "max_queue": self.max_queue, "paused": self.paused, **self.stats}

    def close(self, timeout: float = 10.0) -> None:
        with self.cond:
            self.closing = True
            for job in self.pending:
                job.post(("error", APIError(503, "the server is shutting down", "server_error")))
            self.pending.clear()
            self.cond.notify_all()
        self.thread.join(timeout)

    # -- the inference thread
    def _take_batch(self) -> list[Job] | None:
        with self.cond:
            while not self.closing and (self.paused or not self.pending):
                self.cond.wait()
            if self.closing:
                return None
            if self.batch_wait > 0 and self.pending[0].rows < self.max_batch_size:
                deadline = time.monotonic() + self.batch_wait
                while not self.closing and sum(j.rows for j in self.pending) < self.max_batch_size:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self.cond.wait(left)
                if self.closing or not self.pending:
                    return None if self.closing else []
            first = self.pending.popleft()
            batch, rows = [first], first.rows
            for job in list(self.pending):
                if rows >= self.max_batch_size:
                    break
                if job.config == first.config and rows + job.rows <= self.max_batch_size:
                    self.pending.remove(job)
                    batch.append(job)
                    rows += job.rows
            for job in batch:
                job.started = True
            self.running_jobs = len(batch)
            s = self.stats
            s["batches"] += 1
            s["rows"] += rows
            s["max_batch_rows"] = max(s["max_batch_rows"], rows)
            s["max_batch_requests"] = max(s["max_batch_requests"], len(batch))
            if len(batch) > 1:
                s["batched_requests"] += len(batch)
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if batch is None:
                return
            if batch:
                self._run(batch)
                with self.cond:
                    self.running_jobs = 0

    def _run(self, batch: list[Job]) -> None:
        prompts = [p for job in batch for p in job.prompts]
        seeds = [s for job in batch for s in job.seeds]
        spans, start = [], 0
        for job in batch:
            spans.append((start, start + job.rows))
            start += job.rows
        gen = None
        run_stats: dict = {}
        posted = False
        try:
            gen = stream_blocks(self.model, prompts, batch[0].config, row_seeds=seeds, stats=run_stats)
            for b, parts, finished in gen:
                with self.cond:
                    self.stats["blocks"] += 1
                for job, (lo, hi) in zip(batch, spans):
                    if job.wanted:
                        job.post(("block", b, parts[lo:hi], finished[lo:hi]))
                        posted = True
                if self.block_hook is not None:
                    self.block_hook(b)
                if not any(job.wanted for job in batch):
                    if b < batch[0].config.num_blocks - 1 and not all(finished):
                        with self.cond:
                            self.stats["stopped_early"] += 1
                    break
            for job in batch:
                job.post(("end",))
            with self.cond:
                self.stats["completed"] += len(batch)
            if self.batch_hook is not None:
                self.batch_hook(len(prompts), run_stats.get("nfe", 0))
        except Exception as e:  # never let one bad batch kill the worker
            if len(batch) > 1 and not posted:
                # No request may fail another: decode each alone, so only the culprit gets the error.
                log.warning("a batch of %d failed (%s: %s); retrying its requests one by one", len(batch),
                            type(e).__name__, e)
                if gen is not None:
                    gen.close()
                    gen = None
                for job in batch:
                    self._run([job])
                return
            log.exception("generation failed")
            with self.cond:
                self.stats["errors"] += len(batch)
            err = APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
            for job in batch:
                job.post(("error", err))
        finally:
            if gen is not None:
                gen.close()
