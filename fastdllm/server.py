"""`fastdllm serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn).

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /v1/models/{id},
GET /health. Bodies follow the OpenAI schema, so the official `openai` client works unchanged.

Mapping of the OpenAI parameters onto GenerationConfig:
- `max_tokens` (or `max_completion_tokens`) -> gen_length, rounded up to whole blocks; the output
  is cut back to max_tokens tokens (finish_reason "length" when cut). Without it, the server's
  --gen-length.
- `temperature`, `top_p`, `seed` as such; `n` choices, choice i with seed `seed + i`;
  `stop` (a string or a list): the text is cut at the earliest stop string (finish_reason "stop").
- the dLLM options are extra body fields named as in GenerationConfig (`threshold`,
  `block_length`, `steps`, `cache`, `factor`, `remasking`, `alg`, `alg_temp`, `eps`, `top_k`,
  `stop_at_eos`); they override the server defaults given by the decoding flags. An explicit
  `null` sets None (e.g. `"threshold": null` selects the step schedule). If the server default
  sets `steps` and the request does not, steps scale with gen_length.

Streaming (`stream: true`) sends Server-Sent Events, one chunk per choice per block as soon as the
block is final (a block is the unit in which a diffusion model's tokens become final), then
`data: [DONE]`. Text is decoded incrementally: text that a later token or a stop string spanning
a block boundary could still change is held back, so the chunks concatenate to exactly the
non-streamed text. `stream_options.include_usage` adds a last chunk with usage and no choices.

Concurrency: every request becomes a job in one bounded queue served by ONE inference thread.
The thread takes the oldest job plus any other queued jobs whose GenerationConfig is equal (up to
--max-batch-size rows) and decodes them as one batch with per-row seeds; the generation loop
decodes each row with its own schedule and random stream, as alone (bit-identical in float32 for
prompts of equal length; left padding moves logits by float rounding, which can flip a near-tie). A full
queue answers 503. A job whose client went away is dropped from the queue; a running batch stops
at the next block once none of its jobs needs more output (client gone, stop string reached).

Errors come in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, HTTP 400 for a bad
request (malformed JSON, wrong types, unknown fields, out-of-range values, a prompt beyond the
context), 404 for an unknown route or model, 503 when the queue is full.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import re
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ConfigError
from .generate import GenerationConfig, stream_blocks
from .text import complete

log = logging.getLogger("fastdllm.server")

# Request fields that set a GenerationConfig field of the same name (declared there).
DLLM_FIELDS = tuple(o["name"] for o in GenerationConfig.options() if o["server"])
_KIND_TYPES = {"int": int, "float": float, "str": str, "bool": bool}
MAX_N = 32
MAX_STOP = 16

SERVE_EXAMPLES = """examples:
  fastdllm serve --port 8000
  fastdllm serve --model GSAI-ML/LLaDA-8B-Instruct --device cuda --max-batch-size 16 --threshold 0.9
  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
       -d '{"model": "llada-arith", "messages": [{"role": "user", "content": "Tom has 5 apples..."}],
            "max_tokens": 64, "threshold": 0.8}'

  python -c 'import openai; c = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x");
             print(c.chat.completions.create(model="llada-arith", max_tokens=64,
                   messages=[{"role": "user", "content": "hi"}]).choices[0].message.content)'
"""


# ---- errors ------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_UNION_TAG = re.compile(r"^(str|int|float|bool|none|.*\[.*\]|function-.*|constrained-.*|[A-Z]\w*)$")


def _loc_to_param(loc) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not isinstance(part, str) or _UNION_TAG.match(part):
            continue  # union-member tags that pydantic puts into error locations
        else:
            out += ("." if out else "") + part
    return out or None


def _validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    kind, loc = err["type"], err["loc"]
    param = _loc_to_param(loc)
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {err['msg'].removeprefix('Invalid JSON: ')}", code="invalid_json")
    if kind == "model_type" and not loc:
        return APIError(400, "the request body must be a JSON object", code="invalid_body")
    if kind == "extra_forbidden":
        hint = "; use max_tokens" if loc and loc[-1] == "gen_length" else ""
        return APIError(400, f"unknown field {param!r}{hint}", param=param, code="unknown_field")
    if kind == "missing":
        return APIError(400, f"{param}: required field is missing", param=param, code="missing_field")
    return APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param, code="invalid_value")


# ---- request bodies ----------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class StreamOptions(_Strict):
    include_usage: bool = False


_DecodingFields = create_model(
    "_DecodingFields", __base__=_Strict,
    **{o["name"]: (_KIND_TYPES[o["kind"].removeprefix("optional ")] | None, Field(default=None, description=o["help"]))
       for o in GenerationConfig.options() if o["server"]},
)


class _Common(_DecodingFields):
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1 - MAX_N)
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Any = None

    def check_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if value not in (None, 0, 0.0):
                raise APIError(400, f"{name}: not supported by diffusion decoding (only 0)", param=name,
                               code="unsupported_value")
        if self.logprobs not in (None, False):
            raise APIError(400, "logprobs: not supported", param="logprobs", code="unsupported_value")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings", param="stop", code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options: only allowed with stream: true", param="stream_options",
                           code="invalid_value")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop) if s]


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.top_logprobs is not None:
            raise APIError(400, "top_logprobs: not supported", param="top_logprobs", code="unsupported_value")


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_unsupported(self) -> None:
        super().check_unsupported()
        if self.echo:
            raise APIError(400, "echo: not supported", param="echo", code="unsupported_value")
        if self.suffix:
            raise APIError(400, "suffix: not supported", param="suffix", code="unsupported_value")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of: not supported (only 1)", param="best_of", code="unsupported_value")


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
        try:
            gen = stream_blocks(self.model, prompts, batch[0].config, row_seeds=seeds)
            for b, parts, finished in gen:
                with self.cond:
                    self.stats["blocks"] += 1
                for job, (lo, hi) in zip(batch, spans):
                    if job.wanted:
                        job.post(("block", b, parts[lo:hi], finished[lo:hi]))
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
        except Exception as e:  # never let one bad batch kill the worker
            log.exception("generation failed")
            with self.cond:
                self.stats["errors"] += len(batch)
            err = APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error")
            for job in batch:
                job.post(("error", err))
        finally:
            if gen is not None:
                gen.close()


# ---- incremental decoding -----------------------------------------------------------------------
class ChoiceText:
    """The text of one choice, fed block by block.

    `feed` returns the new text that is safe to send: text that no later token can change. Held
    back: a trailing replacement character (an incomplete UTF-8 sequence), and the longest tail that
    could be the start of a stop string. Once final (stop token, stop string, max_tokens reached or
    the last block), the text equals `complete()` of the whole output cut to max_tokens."""

    def __init__(self, tokenizer, stop_token_ids, stop: list[str], max_tokens: int):
        self.tokenizer, self.stop_token_ids, self.stop = tokenizer, stop_token_ids, stop
        self.max_tokens = max_tokens
        self.ids: list[int] = []
        self.sent = ""
        self.final = False
        self.text = ""
        self.num_tokens = 0
        self.finish_reason: str | None = None

    def _held_tail(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, block_ids: list[int], engine_finished: bool = False, last: bool = False) -> str:
        if self.final:
            return ""
        self.ids.extend(block_ids)
        ids = self.ids[: self.max_tokens]
        stops = set(self.stop_token_ids)
        end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
        text = self.tokenizer.decode(ids[:end])
        found = [text.find(s) for s in self.stop if s in text]
        cut = min(found) if found else -1
        held_from = len(text) - self._held_tail(text)  # a stop string could still start here
        final = (end < len(ids) or engine_finished or last or len(self.ids) >= self.max_tokens
                 or (cut >= 0 and cut <= held_from))
        if final:
            c = complete(self.tokenizer, ids, self.stop_token_ids, self.stop)
            self.final, self.text, self.num_tokens, self.finish_reason = True, c.text, c.num_tokens, c.finish_reason
            safe = c.text
        else:
            safe = text[:held_from].rstrip("\ufffd")
        if not safe.startswith(self.sent):  # cannot happen with prefix-stable decoding; never resend
            log.warning("decoded text is not an extension of the streamed text")
            return ""
        delta = safe[len(self.sent):]
        self.sent = safe
        return delta


# ---- the application ----------------------------------------------------------------------------
@dataclass
class ServerSettings:
    model_name: str
    defaults: GenerationConfig
    max_batch_size: int = 8
    max_queue: int = 64
    batch_wait: float = 0.0
    block_hook: Callable[[int], None] | None = None  # called by the worker after each block


class Server:
    """The state behind the routes: model, tokenizer, server defaults and the scheduler."""

    def __init__(self, model, tokenizer, settings: ServerSettings):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.scheduler = Scheduler(model, settings.max_batch_size, settings.max_queue, settings.batch_wait,
                                   settings.block_hook)
        self.created = int(time.time())

    # -- request -> rows and config
    def check_model(self, name: str) -> None:
        if name != self.settings.model_name:
            raise APIError(404, f"The model {name!r} does not exist; this server serves "
                           f"{self.settings.model_name!r}", param="model", code="model_not_found")

    def config_for(self, req: _Common, max_tokens: int | None) -> tuple[GenerationConfig, int]:
        """The request's GenerationConfig (seed None) and the number of tokens to keep."""
        base = self.settings.defaults.replace(seed=None)
        overrides: dict[str, Any] = {}
        for name in DLLM_FIELDS:
            if name in req.model_fields_set:
                overrides[name] = getattr(req, name)
        for name in ("temperature", "top_p"):
            if getattr(req, name) is not None:
                overrides[name] = getattr(req, name)
        block = overrides.get("block_length", base.block_length)
        keep = max_tokens if max_tokens is not None else base.gen_length
        gen_length = base.gen_length
        if isinstance(block, int) and not isinstance(block, bool) and block > 0:
            gen_length = math.ceil(keep / block) * block
        overrides["gen_length"] = gen_length
        if "steps" not in overrides and base.steps is not None:
            nb = gen_length // block if isinstance(block, int) and block > 0 else 1
            overrides["steps"] = min(gen_length, max(nb, round(base.steps * gen_length / base.gen_length)))
        try:
            config = base.replace(**overrides)
        except ConfigError as e:
            param = "max_tokens" if e.param == "gen_length" else e.param
            raise APIError(400, f"{param}: {e.detail}", param=param, code="invalid_value") from None
        return config, keep

    def base_seed(self, req: _Common) -> int:
        if req.seed is not None:
            return req.seed
        if self.settings.defaults.seed is not None:
            return self.settings.defaults.seed
        return random.randrange(2**31 - 1)

    def check_context(self, prompts: list[list[int]], config: GenerationConfig, param: str) -> None:
        limit = self.model.args.max_seq_len
        longest = max(len(p) for p in prompts)
        if longest + config.gen_length > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has {longest} tokens and "
                f"max_tokens asks for {config.gen_length} (rounded up to whole blocks of {config.block_length})",
                param=param, code="context_length_exceeded")

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages",
                           code="no_chat_template")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in req.messages]
        try:
            return self.tokenizer.encode_chat(messages)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise APIError(400, f"messages: the chat template rejected them ({e})", param="messages",
                           code="invalid_value") from None

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [self.tokenizer.encode(p)]
        elif not p:
            raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
        elif isinstance(p[0], str):
            prompts = [self.tokenizer.encode(s) for s in p]
        elif isinstance(p[0], int):
            prompts = [list(p)]
        else:
            prompts = [list(x) for x in p]
        vocab = self.model.args.vocab_size
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt: must not be empty", param="prompt", code="invalid_value")
            if any(not 0 <= t < vocab or t == self.model.mask_token_id for t in ids):
                raise APIError(400, f"prompt: token ids must be in [0, {vocab}) and not the mask token",
                               param="prompt", code="invalid_value")
        return prompts


def _parse(model_cls, body: bytes):
    try:
        return model_cls.model_validate_json(body or b"")
    except ValidationError as e:
        raise _validation_error(e) from None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(model, tokenizer, settings: ServerSettings) -> FastAPI:
    server = Server(model, tokenizer, settings)

    async def lifespan(app):
        yield
        server.scheduler.close()

    app = FastAPI(title="fastdllm", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible server for diffusion language models")
    app.state.server = server
    app.state.scheduler = server.scheduler

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return APIError(404, f"Unknown route: {request.method} {request.url.path}", code="not_found").response()
        if exc.status_code == 405:
            return APIError(405, f"Method {request.method} not allowed on {request.url.path}",
                            code="method_not_allowed").response()
        return APIError(exc.status_code, str(exc.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        return APIError(400, str(exc.errors()[0].get("msg", "invalid request"))).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unexpected error")
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": settings.model_name, **server.scheduler.snapshot()}

    def model_card() -> dict:
        return {"id": settings.model_name, "object": "model", "created": server.created, "owned_by": "fastdllm",
                "max_model_len": model.args.max_seq_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model_info(model_id: str):
        server.check_model(model_id)
        return model_card()

    async def submit(prompts, seeds, config) -> Job:
        job = Job(prompts, seeds, config, asyncio.get_running_loop())
        try:
            server.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), "server_error", code="queue_full") from None
        return job

    async def events(job: Job, request: Request, watch_disconnect: bool):
        """The job's events; when not streaming, checks every second that the client is still there."""
        while True:
            if watch_disconnect:
                try:
                    item = await asyncio.wait_for(job.events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        server.scheduler.cancel(job)
                        return
                    continue
            else:
                item = await job.events.get()
            yield item
            if item[0] in ("end", "error"):
                return

    async def run(kind: str, request: Request):
        body = await request.body()
        req = _parse(ChatCompletionRequest if kind == "chat" else CompletionRequest, body)
        server.check_model(req.model)
        req.check_unsupported()
        if kind == "chat":
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            prompts, param = [server.chat_prompt(req)], "messages"
        else:
            max_tokens = req.max_tokens
            prompts, param = server.completion_prompts(req), "prompt"
        config, keep = server.config_for(req, max_tokens)
        server.check_context(prompts, config, param)
        seed = server.base_seed(req)
        limit = max(MAX_N, settings.max_batch_size)
        if len(prompts) * req.n > limit:
            raise APIError(400, f"n: prompts x n = {len(prompts) * req.n} choices; at most {limit} per request",
                           param="n", code="invalid_value")
        rows = [p for p in prompts for _ in range(req.n)]
        seeds = [seed + i for _ in prompts for i in range(req.n)]
        stop = req.stop_list()
        choices = [ChoiceText(tokenizer, model.stop_token_ids, stop, keep) for _ in rows]
        prompt_tokens = sum(len(p) for p in prompts)
        job = await submit(rows, seeds, config)
        meta = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}",
                "created": int(time.time()), "model": settings.model_name}
        last_block = config.num_blocks - 1

        def on_block(item) -> list[tuple[int, str, bool]]:
            """Feed a block to every choice: [(index, new text, became final)]."""
            out = []
            _, b, parts, finished = item
            for i, ch in enumerate(choices):
                if ch.final:
                    continue
                delta = ch.feed(parts[i], finished[i], b == last_block)
                out.append((i, delta, ch.final))
            if all(ch.final for ch in choices):
                job.satisfied = True
            return out

        def finish_all() -> list[tuple[int, str, bool]]:
            out = []
            for i, ch in enumerate(choices):
                if not ch.final:
                    out.append((i, ch.feed([], False, True), True))
            return out

        if not req.stream:
            ended = False
            try:
                async for item in events(job, request, watch_disconnect=True):
                    if item[0] == "error":
                        ended = True
                        raise item[1]
                    if item[0] == "end":
                        ended = True
                    elif item[0] == "block":
                        on_block(item)
                        if job.satisfied:
                            ended = True
                            break
                if not ended:  # the client went away while waiting
                    return JSONResponse({}, status_code=499)
                finish_all()
            finally:
                if not ended:
                    server.scheduler.cancel(job)
            usage = _usage(prompt_tokens, sum(ch.num_tokens for ch in choices))
            if kind == "chat":
                return {**meta, "object": "chat.completion", "system_fingerprint": None,
                        "choices": [{"index": i, "message": {"role": "assistant", "content": ch.text},
                                     "logprobs": None, "finish_reason": ch.finish_reason}
                                    for i, ch in enumerate(choices)],
                        "usage": usage}
            return {**meta, "object": "text_completion", "system_fingerprint": None,
                    "choices": [{"index": i, "text": ch.text, "logprobs": None, "finish_reason": ch.finish_reason}
                                for i, ch in enumerate(choices)],
                    "usage": usage}

        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        def chunk(i: int, delta: str | None, finish: str | None, role: bool = False) -> str:
            if kind == "chat":
                d = {} if delta is None else {"content": delta}
                if role:
                    d = {"role": "assistant", "content": ""}
                c = {"index": i, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": i, "text": delta or "", "logprobs": None, "finish_reason": finish}
            body = {**meta, "object": obj, "system_fingerprint": None, "choices": [c]}
            if include_usage:
                body["usage"] = None
            return _sse(body)

        def render(updates) -> list[str]:
            out = []
            for i, delta, became_final in updates:
                if delta:
                    out.append(chunk(i, delta, None))
                if became_final:
                    out.append(chunk(i, None, choices[i].finish_reason))
            return out

        async def stream():
            done = False
            try:
                if kind == "chat":
                    for i in range(len(choices)):
                        yield chunk(i, None, None, role=True)
                async for item in events(job, request, watch_disconnect=False):
                    if item[0] == "error":
                        err: APIError = item[1]
                        yield _sse(err.body())
                        yield "data: [DONE]\n\n"
                        done = True
                        return
                    if item[0] == "block":
                        for s in render(on_block(item)):
                            yield s
                        if job.satisfied:
                            break
                for s in render(finish_all()):
                    yield s
                if include_usage:
                    yield _sse({**meta, "object": obj, "system_fingerprint": None, "choices": [],
                                "usage": _usage(prompt_tokens, sum(ch.num_tokens for ch in choices))})
                yield "data: [DONE]\n\n"
                done = True
            finally:
                if not done:  # the client went away (the response task was cancelled)
                    server.scheduler.cancel(job)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run("chat", request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run("completion", request)

    return app


# ---- command line -------------------------------------------------------------------------------
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive_int.__name__ = "positive integer"


def default_model_name(path: str | None) -> str:
    if path is None:
        return "llada-arith"
    return str(path).rstrip("/").split("/")[-1] or str(path)


def main(argv: list[str] | None = None) -> int:
    from .cli_args import ArgumentParser, UserError, add_generation_args, add_model_args, config_from_args, load_model_or_exit

    p = ArgumentParser(
        prog="fastdllm serve",
        description="An OpenAI-compatible HTTP server (POST /v1/chat/completions, /v1/completions; GET "
                    "/v1/models, /health). The decoding flags set the server defaults; requests override them "
                    "with extra body fields of the same names (threshold, block_length, cache, ...).",
        epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the folder name, or llada-arith for the embedded model)")
    s.add_argument("--max-batch-size", type=_positive_int, default=8,
                   help="most rows decoded together; 1 turns batching off (default %(default)s)")
    s.add_argument("--max-queue", type=_positive_int, default=64,
                   help="most requests waiting; beyond it, 503 (default %(default)s)")
    s.add_argument("--batch-wait-ms", type=float, default=0.0,
                   help="wait up to this long for more requests before starting a batch (default 0)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_generation_args(p, GenerationConfig())
    args = p.parse_args(argv)
    config = config_from_args(args)
    if not 0 < args.port < 65536:
        raise UserError(f"--port: must be in 1..65535 (got {args.port})")
    if args.batch_wait_ms < 0:
        raise UserError("--batch-wait-ms: must be >= 0")
    model, tokenizer = load_model_or_exit(args)
    name = args.served_model_name or default_model_name(args.model)
    settings = ServerSettings(name, config, args.max_batch_size, args.max_queue, args.batch_wait_ms / 1000)
    app = create_app(model, tokenizer, settings)
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    print(f"fastdllm serve: model {name!r} on http://{args.host}:{args.port}/v1 (max batch {args.max_batch_size}, "
          f"max queue {args.max_queue})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
