"""The bounded queue and the one inference thread that batches compatible jobs."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import GenerationConfig
from ..engine.decoder import BlockDecoder
from ..engine.kv import KVRunner
from ..engine.kv.prefix import DEFAULT_BUDGET_BYTES, PrefixStore
from ..engine.policies import PolicySource
from ..engine.ranks import LocalCommands, constraint_specs, placed_spec
from ..engine.rows import layout_columns, prefix_tokens, shares_forwards
from ..models.tp import RankLost
from .schema import APIError

log = logging.getLogger("fastdllm.server")


# ---- the queue and the inference worker ---------------------------------------------------------
class QueueFull(Exception):
    pass


# What the worker posts to a job, in order: blocks as they become final, then its end or failure.
@dataclass
class BlockFinal:
    """Blocks became final at a step: per row the tokens of those that did (in order; empty for a
    row with none), which rows finished (a stop token), which rows' answers are now complete;
    `block` the latest block among them (rows move on their own clocks)."""

    block: int
    tokens: list[list[int]]
    finished: list[bool]
    last: list[bool]
    # per row asking for them, per token: (log-probability, top tokens) or None (`Row.block_logprobs`)
    logprobs: list[list | None] | None = None
    # per row, what each of its speculative verifications accepted so far (LinearSpec); None: none
    acceptances: list[list[int]] | None = None


@dataclass
class CanvasStep:
    """A step's state of a job's rows (`stream_options.include_canvas`): per row that took part,
    (choice index, its answer region's token ids, the positions the step revealed, those it
    edited, its block, its forwards so far). Positions are answer positions; a block revealed whole
    while it was a later one (multi-block decoding) shows when it becomes final."""

    rows: list[tuple[int, list[int], list[int], list[int], int, int]]


@dataclass
class JobEnded:
    """Every row of the job is done."""


@dataclass
class JobFailed:
    """The job failed; `error` is what its request answers."""

    error: APIError


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
    # per row, blocks sent so far (a job decoded again alone does not send them twice)
    blocks_posted: list[int] = field(default_factory=list)
    # Per row, the grammar its answer follows (`constraints.py`; response_format), or None.
    constraints: list | None = None
    canvas: bool = False  # post each step's state of its rows (`CanvasStep`)
    canvases: list[list[int]] | None = None  # per row, its answer region as the canvas shows it
    placed: list | None = None  # per row, its images' (columns, soft tokens) (`Transformer.place_images`)
    chain_keys: dict = field(default_factory=dict, repr=False)  # page size -> `prompt_blocks`

    @property
    def rows(self) -> int:
        return len(self.prompts)

    def pages(self, answer: bool = True, page_size: int | None = None) -> int:
        """The pages its rows hold at most in a K/V pool of pages of `page_size` (default: its block
        length, as a batch it starts pages): each row's columns (`rows.layout_columns`) in whole
        pages; without `answer`, its prompts' alone."""
        cfg, size = self.config, page_size or self.config.block_length
        gen = 0 if answer else cfg.gen_length
        return sum(-(-(layout_columns(len(p), cfg) - gen) // size) for p in self.prompts)

    def request(self, page_size: int) -> tuple:
        """What the runner asks of a job to admit it into a pool of pages of `page_size`
        (`KVRunner.pages_held`)."""
        return self.config, self.pages(page_size=page_size), self.prompt_blocks(page_size)

    def prompt_blocks(self, page_size: int) -> list[list[int]]:
        """Per row, the chain keys of its prompt's full pages (`PrefixStore.keys`: a key stands for
        the whole prefix up to its page's end)."""
        if page_size not in self.chain_keys:
            placed = self.placed or [None] * len(self.prompts)
            keys = [PrefixStore.chain_keys(prefix_tokens(p, e), page_size) for p, e in zip(self.prompts, placed)]
            self.chain_keys[page_size] = keys
        return self.chain_keys[page_size]

    @property
    def wanted(self) -> bool:
        return not (self.cancelled or self.satisfied)

    def post(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass


class Scheduler:
    """One bounded FIFO queue of jobs, served by one inference thread that batches them.

    Jobs whose configs differ at most in the fields declared per row (`rows.shares_forwards`:
    lengths, steps, thresholds, decoders, and block lengths where the model allows) decode together.
    With `continuous` (the default), a job that arrives while a batch runs joins it at the
    next step, up to `max_batch_size` rows, so a short request is not stuck behind a long one;
    without, it waits for the batch to finish. A row leaves as soon as it is done.

    `kv_cache_bytes` bounds the K/V of the running rows, held in a pool of pages of a block that
    the scheduler's runner (`kv`, `engine.kv.KVRunner`) allocates once, with the prefix store of
    `prefix_cache_bytes` over it: a job's rows hold at most their own columns in whole pages
    (`Job.pages`), and a prompt block that an earlier row holds is counted once where the rows
    share it by reference (`KVRunner.pages_held`). A job is admitted while the running jobs' pages and its
    own fit; the others wait in the queue (`never_fits`: one that could never fit, which a server
    refuses).

    `commands` (`ranks.Commands` under tensor parallelism) carries each decoder command to the
    other ranks; `on_rank_lost` is called once when one is gone (every request then failed with a
    503 and the queue closed)."""

    def __init__(
        self,
        model,
        max_batch_size: int = 8,
        max_queue: int = 64,
        batch_wait: float = 0.0,
        block_hook: Callable[[int], None] | None = None,
        continuous: bool = True,
        policies: PolicySource = None,
        commands: LocalCommands | None = None,
        kv_cache_bytes: int | None = None,
        prefix_cache_bytes: int = DEFAULT_BUDGET_BYTES,
    ):
        self.model = model
        self.kv_cache_bytes = kv_cache_bytes
        self.kv = KVRunner(model, kv_cache_bytes, prefix_cache_bytes)  # the batches' rows page into its pool
        self.token_kv_bytes = self.kv.page_bytes(1)  # one position of every layer, on this rank
        self.kv_in_use = 0  # bytes the running batch's layout holds (what `kv_cache_bytes` bounds)
        self.commands = commands or LocalCommands()
        self.on_rank_lost: Callable[[RankLost], None] | None = None
        self.rank_lost: RankLost | None = None
        self.policies = policies  # the decoding policies of every batch (default: each config's own)
        self.continuous = continuous
        self.block_hook = block_hook  # called in the worker after each step that ended a block (tests, diagnostics)
        self.batch_hook: Callable[[int, int], None] | None = None  # (rows, forward passes) after each batch
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batch_wait = batch_wait
        self.cond = threading.Condition()
        self.pending: deque[Job] = deque()
        self.paused = False
        self.closing = False
        self.running_jobs = 0
        self.stats = dict(
            requests=0,
            rejected=0,
            completed=0,
            cancelled=0,
            errors=0,
            batches=0,
            batched_requests=0,
            max_batch_rows=0,
            max_batch_requests=0,
            rows=0,
            steps=0,
            blocks=0,
            stopped_early=0,
            joined=0,
        )
        self.thread = threading.Thread(target=self._loop, name="fastdllm-inference", daemon=True)
        self.thread.start()

    # -- called from the event loop
    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise QueueFull(str(self.rank_lost) if self.rank_lost else "the server is shutting down")
            if len(self.pending) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFull(
                    f"the server is busy: {len(self.pending)} requests are queued (--max-queue "
                    f"{self.max_queue}); retry later"
                )
            self.pending.append(job)
            self.stats["requests"] += 1
            self.cond.notify_all()

    def kv_bytes(self, job: Job, answer: bool = True) -> int:
        """The bytes of the pages the job's rows hold at most (without `answer`: their prompts')."""
        return job.pages(answer) * job.config.block_length * self.token_kv_bytes

    def held_bytes(self, jobs: list[Job], page_size: int) -> int:
        """The bytes of the pages the jobs' rows hold at most together in a pool of pages of
        `page_size` (`KVRunner.pages_held`)."""
        return self.kv.held_bytes([job.request(page_size) for job in jobs], page_size)

    def never_fits(self, job: Job) -> bool:
        """Whether the job's rows alone exceed `kv_cache_bytes`."""
        return self.kv_cache_bytes is not None and self.kv_bytes(job) > self.kv_cache_bytes

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
            return {
                "queued": len(self.pending),
                "running": self.running_jobs,
                "max_batch_size": self.max_batch_size,
                "max_queue": self.max_queue,
                "kv_cache_bytes": self.kv_cache_bytes,
                "kv_bytes_in_use": self.kv_in_use,
                "paused": self.paused,
                **self.stats,
            }

    def close(self, timeout: float = 10.0) -> None:
        with self.cond:
            self.closing = True
            for job in self.pending:
                job.post(JobFailed(APIError(503, "the server is shutting down", "server_error")))
            self.pending.clear()
            self.cond.notify_all()
        self.thread.join(timeout)

    # -- the inference thread
    def _take_batch(self) -> list[Job] | None:
        """The jobs a new batch starts with (None: the server is closing)."""
        with self.cond:
            while not self.closing and (self.paused or not self.pending):
                if not self.cond.wait(self.commands.idle_tick) and not self.pending:
                    return []  # idle: the other ranks hear from rank 0 (`_loop` ticks)
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
            fits = functools.partial(shares_forwards, self.model, first.config)
            same = self._compatible(fits, [first], first.config.block_length, skip=True)
            return [first] + same

    def _compatible(self, fits, batch: list[Job], page_size: int, skip: bool = False) -> list[Job]:
        """Queued jobs that can decode with `batch` (its jobs, whose pool has pages of
        `page_size`), in queue order, up to max_batch_size rows and within `kv_cache_bytes`. With
        `skip` (a batch starting) the whole queue is looked through; otherwise (joining a running
        batch) it stops at the first job that cannot join: that job waits for the batch to drain,
        and no later one overtakes it. Call with the lock held."""
        taken = []
        rows = sum(j.rows for j in batch)
        for job in list(self.pending):
            if rows >= self.max_batch_size or self.paused:
                break
            room = self.kv.can_admit((j.request(page_size) for j in batch + taken + [job]), page_size)
            if fits(job.config) and rows + job.rows <= self.max_batch_size and room:
                self.pending.remove(job)
                taken.append(job)
                rows += job.rows
            elif not skip:
                break
        return taken

    def _loop(self) -> None:
        try:
            while True:
                batch = self._take_batch()
                if batch is None:
                    return
                if batch:
                    self._run(batch)
                    with self.cond:
                        self.running_jobs, self.kv_in_use = 0, 0
                else:
                    self.commands.tick()
        except RankLost as e:
            self._lose_rank(e)
        finally:
            if self.rank_lost is None:
                self.commands.stop()

    def _lose_rank(self, error: RankLost) -> None:
        """Another rank is gone: every queued request gets a 503 (those running got theirs), and
        nothing more is taken."""
        log.error("%s: failing every request and stopping", error)
        with self.cond:
            self.rank_lost, self.closing = error, True
            for job in self.pending:
                job.post(JobFailed(APIError(503, str(error), "server_error")))
            self.pending.clear()
            self.cond.notify_all()
        if self.on_rank_lost is not None:
            self.on_rank_lost(error)

    def _run(self, jobs: list[Job], alone: bool = False) -> None:
        """Decode `jobs` and, unless `alone`, every compatible job that arrives while they run: it
        joins at the next step (continuous batching)."""
        config = jobs[0].config
        run = self.commands.run
        try:
            decoder = run(("new", config), BlockDecoder, self.model, config, policies=self.policies, kv=self.kv)
        except RankLost:
            raise
        except Exception as e:  # a config the loop refuses fails its requests, never the server
            self._fail(jobs, e, log_it=False)
            return
        running: dict[Job, list] = {}
        together = 0  # jobs that shared this batch

        def admit(new: list[Job]) -> None:
            nonlocal together
            for job in new:
                specs = constraint_specs(job.constraints)
                command = ("add", job.prompts, job.seeds, job.config, specs, placed_spec(job.placed))
                try:
                    running[job] = run(
                        command,
                        decoder.add,
                        job.prompts,
                        row_seeds=job.seeds,
                        config=job.config,
                        tags=[job] * job.rows,
                        constraints=job.constraints,
                        placed=job.placed,
                    )
                except RankLost:
                    raise
                except Exception as e:  # a request the loop refuses fails alone
                    self._fail([job], e, log_it=False)
                    continue
                together += 1
                with self.cond:
                    self.stats["rows"] += job.rows
                    self.stats["joined"] += bool(decoder.rows)
                    # Jobs that shared a batch: the first one counts when a second arrives.
                    self.stats["batched_requests"] += 2 if together == 2 else int(together > 2)

        if not alone:
            with self.cond:
                self.stats["batches"] += 1
        admit(jobs)
        try:
            while running:
                rows = sum(len(r) for r in running.values())
                with self.cond:
                    s = self.stats
                    self.running_jobs = len(running)
                    self.kv_in_use = self.held_bytes(list(running), decoder.pages.page_size)
                    s["max_batch_rows"] = max(s["max_batch_rows"], rows)
                    s["max_batch_requests"] = max(s["max_batch_requests"], len(running))
                nfe = decoder.nfe
                try:
                    step = run(("step",), decoder.step)
                except RankLost:
                    raise
                except Exception as e:
                    self._recover(list(running), e, alone)
                    return
                with self.cond:
                    self.stats["steps"] += 1
                    self.stats["blocks"] += len({b for _, b, _ in decoder.last_blocks})
                if self.batch_hook is not None:
                    self.batch_hook(rows, decoder.nfe - nfe)
                self._post_canvas(decoder, step, running)
                for job in self._post_blocks(decoder, running):
                    del running[job]
                if self.block_hook is not None and decoder.last_blocks:
                    self.block_hook(max(b for _, b, _ in decoder.last_blocks))
                for job in [j for j in running if not j.wanted]:  # nobody waits for its blocks
                    rows = running.pop(job)
                    batch = decoder.batch
                    indices = [i for i, r in enumerate(batch) if any(r is x for x in rows)]
                    run(("drop", indices), decoder.drop, rows)
                    job.post(JobEnded())
                    with self.cond:
                        self.stats["stopped_early"] += 1
                if self.continuous and not alone:
                    with self.cond:
                        joining = (
                            []
                            if self.closing
                            else self._compatible(decoder.accepts, list(running), decoder.pages.page_size)
                        )
                    admit(joining)
        except RankLost as e:  # the ranks cannot go on: the requests in flight get a 503
            self._fail(list(running), e, log_it=False)
            raise
        except Exception as e:  # never let one bad batch kill the worker
            self._fail(list(running), e)

    def _post_canvas(self, decoder: BlockDecoder, step, running: dict) -> None:
        """Send each job that asked for it the state of its rows after this step."""
        jobs = [j for j in running if j.canvas and j.wanted]
        if not jobs or step is None:
            return
        mask = decoder.mask_id
        where = {id(r): j for j, r in enumerate(step.rows)}
        tokens, chosen = step.tokens.tolist(), step.chosen.tolist()
        edited = None if step.edited is None else step.edited.tolist()
        final: dict[int, list] = {}
        for r, b, ids in decoder.last_blocks:
            final.setdefault(id(r), []).append((b, ids))
        for job in jobs:
            rows = running[job]
            if job.canvases is None:
                job.canvases = [[mask] * r.asked for r in rows]
                for canvas, r in zip(job.canvases, rows):
                    for pos, t in r.fixed:
                        canvas[pos] = t
            updates = []
            for k, r in enumerate(rows):
                j = where.get(id(r))
                if j is None:
                    continue
                canvas, block = job.canvases[k], step.blocks[j]
                a_lo, a_hi, b_lo, b_hi = r.answer_span(block)
                canvas[a_lo:a_hi] = tokens[j][b_lo:b_hi]
                for b, ids in final.get(id(r), []):
                    lo, hi, _, _ = r.answer_span(b)
                    canvas[lo:hi] = ids
                if r.done:
                    canvas[:] = r.answer.tolist()
                revealed = [a_lo + p - b_lo for p in range(b_lo, b_hi) if chosen[j][p]]
                edits = [] if edited is None else [a_lo + p - b_lo for p in range(b_lo, b_hi) if edited[j][p]]
                updates.append((k, list(canvas), revealed, edits, block, r.nfe))
            if updates:
                job.post(CanvasStep(updates))

    def _post_blocks(self, decoder: BlockDecoder, running: dict) -> list[Job]:
        """Send each job the blocks its rows just ended; returns the jobs that are complete."""
        decoded: dict[int, list[tuple[int, list[int]]]] = {}
        for r, b, ids in decoder.last_blocks:
            decoded.setdefault(id(r), []).append((b, ids))
        complete = []
        for job, rows in running.items():
            mine = [decoded.get(id(r), []) for r in rows]
            if not any(mine):
                continue
            if len(job.blocks_posted) != len(rows):
                job.blocks_posted = [0] * len(rows)
            tokens, latest = [], 0
            logprobs = [] if job.config.logprobs is not None else None
            for j, blocks in enumerate(mine):
                new = [(b, ids) for b, ids in blocks if b >= job.blocks_posted[j]]
                tokens.append([t for _, ids in new for t in ids])
                if logprobs is not None:
                    logprobs.append([lp for b, _ in new for lp in rows[j].block_logprobs.pop(b)])
                if new:
                    job.blocks_posted[j] = new[-1][0] + 1
                    latest = max(latest, new[-1][0])
            if job.wanted and any(tokens):
                last = [r.done for r in rows]
                accepted = [list(r.acceptances) for r in rows] if any(r.acceptances for r in rows) else None
                job.post(BlockFinal(latest, tokens, [r.finished for r in rows], last, logprobs, accepted))
            if all(r.done for r in rows):
                job.post(JobEnded())
                with self.cond:
                    self.stats["completed"] += 1
                complete.append(job)
        return complete

    def _recover(self, jobs: list[Job], error: Exception, alone: bool) -> None:
        """A batched step failed. No request may fail another: each job is decoded again alone (its
        blocks already sent are not sent twice), so only the culprit gets the error."""
        if alone:
            self._fail(jobs, error)
            return
        log.warning(
            "a batch of %d requests failed (%s: %s); retrying them one by one", len(jobs), type(error).__name__, error
        )
        for job in jobs:
            for constraint in job.constraints or ():
                if constraint is not None:
                    constraint.reset()  # its grammar starts over with the answer
            self._run([job], alone=True)

    def _fail(self, jobs: list[Job], error: Exception, log_it: bool = True) -> None:
        if log_it:
            log.exception("generation failed", exc_info=error)
        with self.cond:
            self.stats["errors"] += len(jobs)
        if isinstance(error, RankLost):
            err = APIError(503, str(error), "server_error")
        elif isinstance(error, ValueError):
            err = APIError(400, str(error), "invalid_request_error")
        else:
            err = APIError(500, f"generation failed: {type(error).__name__}: {error}", "server_error")
        for job in jobs:
            job.post(JobFailed(err))
