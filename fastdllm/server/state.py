"""The server's state and its reading of a request: settings, model and scheduler, and a request
turned into rows, seeds, a GenerationConfig and grammar constraints (`Server.plan`)."""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import PRESETS, ConfigError, GenerationConfig
from ..engine.constraints import GrammarConstraint, response_format_constraint
from ..engine.decode import check_canvas
from ..engine.generation import generate
from ..engine.ranks import LocalCommands
from ..text import tool_calls
from ..text.infill import encode_infill
from .metrics import ServerMetrics
from .scheduler import Job, QueueFull, Scheduler
from .schema import DLLM_FIELDS, MAX_N, APIError, ChatCompletionRequest, CompletionRequest, _Common

log = logging.getLogger("fastdllm.server")


@dataclass
class ServerSettings:
    model_name: str
    defaults: GenerationConfig
    max_batch_size: int = 8
    max_queue: int = 64
    batch_wait: float = 0.0
    block_hook: Callable[[int], None] | None = None  # called by the worker after each block
    aliases: tuple[str, ...] = ()  # more ids clients may use for the model
    strict: bool = False  # refuse the fields that are otherwise accepted and ignored
    api_key: str | None = None  # when set, every route but /health and /version needs "Bearer <key>"
    max_body_bytes: int = 4 * 1024 * 1024  # larger request bodies get 413
    continuous: bool = True  # requests join the running batch at its next step
    tool_call_parser: str | None = None  # "hermes" | "llama3_json" (None: the one the chat template teaches)
    presets: dict[str, GenerationConfig] = field(default_factory=dict)  # more presets requests may name
    kv_cache_bytes: int | None = None  # the running rows' K/V budget (`Scheduler`); None: unbounded
    prefix_cache_bytes: int = 256 << 20  # the prompt K/V the prefix store keeps (`engine.kv.prefix`)

    adapters: tuple[str, ...] = ()  # the model's LoRA adapters, each served as a model of its name

    @property
    def names(self) -> tuple[str, ...]:
        """Every id a request may name: the model, its aliases, its adapters."""
        base = (self.model_name, *[a for a in self.aliases if a != self.model_name])
        return (*base, *[a for a in self.adapters if a not in base])


def default_model_names(path: str | None) -> list[str]:
    """The ids served for `--model PATH` (the first is the one reported): the embedded model's name;
    a local folder's or file's name (a GGUF file's without `.gguf`), and the path as typed; else
    PATH as given (a hub id keeps its organisation: `Dream-org/Dream-v0-Instruct-7B`, as vLLM
    serves it)."""
    if path is None:
        return ["llada-arith"]
    local = Path(path).expanduser()
    if local.exists():
        name = local.resolve().name
        name = name[: -len(".gguf")] if name.endswith(".gguf") else name
        return list(dict.fromkeys([name, str(path)]))
    return [str(path).rstrip("/") or str(path)]


class Server:
    """The state behind the routes: model, tokenizer, server defaults and the scheduler."""

    def __init__(self, model, tokenizer, settings: ServerSettings, commands: LocalCommands | None = None):
        """`commands`: how forwards reach the other ranks of a tensor-parallel model (`ranks.py`)."""
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        lora = getattr(model, "lora", None)
        if lora is not None and not settings.adapters:
            settings.adapters = tuple(lora.names)
        self.commands = commands or LocalCommands()
        self.scoring_lock = threading.Lock()  # scoring forwards run one request at a time, off the event loop
        self.scheduler = Scheduler(
            model,
            settings.max_batch_size,
            settings.max_queue,
            settings.batch_wait,
            settings.block_hook,
            continuous=settings.continuous,
            commands=self.commands,
            kv_cache_bytes=settings.kv_cache_bytes,
            prefix_cache_bytes=settings.prefix_cache_bytes,
        )
        self.metrics = ServerMetrics(self.scheduler, settings.model_name)
        self.scheduler.batch_hook = self.metrics.on_batch
        self.created = int(time.time())
        d = settings.defaults
        server_wide = {"compile": d.compile, "deterministic": d.deterministic}
        # Named presets fitted to the model's family; tuned ones were made for it and stay as written.
        self.presets, self.unfit = {}, {}  # presets that cannot decode this model: why not
        for name in PRESETS:
            try:
                self.presets[name] = GenerationConfig.preset(name).fit_to_model(model, own_block=name == "default")
            except ValueError as e:  # WeDLM's one-position blocks on a block-causal model, say
                self.unfit[name] = str(e)
        self.presets.update(settings.presets)
        self.presets = {name: c.replace(**server_wide) for name, c in self.presets.items()}
        self.warmed, self.warm_error = False, None  # set by the app's warm-up decode

    def broken(self) -> str | None:
        """Why this server will never answer again (None: it may): what a supervisor restarts it
        for (Ray Serve's health check), unlike a full queue or a warm-up still running."""
        if self.warm_error is not None:
            return f"the warm-up decode failed: {self.warm_error}"
        s = self.scheduler
        if s.rank_lost is not None:
            return str(s.rank_lost)
        if not s.thread.is_alive() and not s.closing:
            return "the inference worker stopped"
        return None

    def not_ready(self) -> str | None:
        """Why the server cannot answer a request now (None: it can)."""
        if not self.warmed:
            return "warming up"
        broken = self.broken()
        if broken is not None:
            return broken
        s = self.scheduler
        if s.closing:
            return "shutting down"
        if len(s.pending) >= s.max_queue:
            return f"the queue is full ({len(s.pending)} requests)"
        if s.paused:
            return "paused"
        return None

    # -- request -> rows and config
    def served_name(self, requested: str) -> str:
        """The model id a response names: an adapter's own (as vLLM echoes it), else the model's."""
        return requested if requested in self.settings.adapters else self.settings.model_name

    def check_model(self, name: str) -> None:
        if name not in self.settings.names:
            raise APIError(
                404,
                f"The model {name!r} does not exist; this server serves "
                f"{', '.join(repr(n) for n in self.settings.names)}",
                param="model",
                code="model_not_found",
            )

    def config_for(self, req: _Common, max_tokens: int | None) -> tuple[GenerationConfig, int]:
        """The request's GenerationConfig (seed None) and the number of tokens to keep: the
        server's defaults, or the preset it names, with the request's own fields."""
        base = self.settings.defaults
        if req.preset is not None:
            if req.preset in self.unfit and req.preset not in self.presets:
                raise APIError(
                    400,
                    f"preset: {req.preset!r} does not apply to this model ({self.unfit[req.preset]})",
                    param="preset",
                    code="invalid_value",
                )
            if req.preset not in self.presets:
                raise APIError(
                    400,
                    f"preset: {req.preset!r} is not one of {', '.join(self.presets)}",
                    param="preset",
                    code="invalid_value",
                )
            base = self.presets[req.preset]
        base = base.replace(seed=None, adapter=req.model if req.model in self.settings.adapters else None)
        overrides: dict[str, Any] = {}
        for name in DLLM_FIELDS:
            if name in req.model_fields_set:
                overrides[name] = getattr(req, name)
        for name in ("temperature", "top_p"):
            if getattr(req, name) is not None:
                overrides[name] = getattr(req, name)
        keep = max_tokens if max_tokens is not None else base.gen_length
        try:
            config = base.with_max_new_tokens(keep, **overrides)
        except ConfigError as e:
            param = "max_tokens" if e.param in ("gen_length", "max_new_tokens") else e.param
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
        longest = max(len(p) for p in prompts) + len(config.suffix or ()) + config.columns_past_answer
        if longest + config.gen_length > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens; the prompt has {longest} tokens and "
                f"max_tokens asks for {config.gen_length} (rounded up to whole blocks of {config.block_length})",
                param=param,
                code="context_length_exceeded",
            )

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if not self.tokenizer.chat_template:
            raise APIError(
                400, "this model has no chat template; use /v1/completions", param="messages", code="no_chat_template"
            )
        messages = tool_calls.template_messages([m.for_template() for m in req.messages])
        tools = req.tools if req.tools and req.tool_choice != "none" else None
        if tools and not tool_calls.template_reads_tools(self.tokenizer.chat_template):
            messages = [tool_calls.tools_system_message(tools), *messages]  # the template would drop them
            tools = None
        try:
            return self.tokenizer.encode_chat(messages, tools=tools)
        except Exception as e:  # a template that rejects the conversation (e.g. role order)
            raise APIError(
                400, f"messages: the chat template rejected them ({e})", param="messages", code="invalid_value"
            ) from None

    def place_images(self, req, prompts: list[list[int]], tower: bool = True) -> tuple[list[list[int]], list | None]:
        """A chat's `image_url` parts (data URLs) read and placed in its prompt by the model
        (`Transformer.place_images`, its vision tower run here, off the event loop): the prompts
        and per prompt its images' (columns, soft tokens); None without images. Without `tower`,
        the placed prompts alone (`Transformer.placed_ids`: counted from the pictures' sizes)."""
        urls = [u for m in getattr(req, "messages", None) or () for u in m.images()]
        if not urls:
            return prompts, None
        if not self.model.takes_images:
            raise APIError(
                400,
                f"messages: image_url parts need a model that reads images; {req.model} takes text only",
                param="messages",
                code="unsupported_value",
            )
        try:
            if not tower:
                return [self.model.placed_ids(prompts[0], urls)], None
            ids, placed = self.model.place_images(prompts[0], urls)
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        return [ids], [placed]

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
                raise APIError(
                    400,
                    f"prompt: token ids must be in [0, {vocab}) and not the mask token",
                    param="prompt",
                    code="invalid_value",
                )
        return prompts

    # -- a request, read
    def plan(self, endpoint, req) -> RequestPlan:
        """Everything decided before a request's job is queued: the checks (model, fields, prompt
        and context length, n), its rows and seeds, its config, and its grammar constraints."""
        self.check_model(req.model)
        req.check_unsupported(self.settings.strict)
        ignored = req.ignored_fields()
        if ignored:
            log.info("request fields accepted and ignored: %s", ", ".join(ignored))
        self.check_prompt_chars(endpoint, req)
        prompts = endpoint.prompts(self, req)
        prompts, placed = self.place_images(req, prompts)
        config, keep = self.config_for(req, endpoint.max_tokens(req))
        config = config.replace(logprobs=req.reported_logprobs())
        try:
            config = encode_infill(config, self.tokenizer, self.model.mask_token_id, keep)
        except ConfigError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None
        if config.suffix is not None and self.model.args.block_size:
            raise APIError(
                400,
                "suffix: this model's attention is block-causal: no block sees text after it, so an "
                "answer cannot lead into a suffix (fixed words work)",
                param="suffix",
                code="unsupported_value",
            )
        self.check_context(prompts, config, endpoint.prompt_param)
        try:
            check_canvas(self.model, config)
        except ValueError as e:
            param = str(e).split(":", 1)[0]
            raise APIError(400, str(e), param=param, code="unsupported_value") from None
        limit = max(MAX_N, self.settings.max_batch_size)
        if len(prompts) * req.n > limit:
            raise APIError(
                400,
                f"n: prompts x n = {len(prompts) * req.n} choices; at most {limit} per request",
                param="n",
                code="invalid_value",
            )
        seed = self.base_seed(req)
        rows = [p for p in prompts for _ in range(req.n)]
        placed = None if placed is None else [e for e in placed for _ in range(req.n)]
        seeds = [seed + i for _ in prompts for i in range(req.n)]
        tool_mode = self.tool_mode(endpoint, req)
        constraints = self.constraints(req, tool_mode, len(rows), keep)
        if constraints is not None and (config.fixed or config.suffix is not None):
            param = "fixed" if config.fixed else "suffix"
            raise APIError(
                400,
                f"{param}: not with response_format or forced tool calls (a grammar reveals the answer left to right)",
                param=param,
                code="invalid_value",
            )
        prompt_tokens = sum(len(p) for p in prompts)
        canvas = bool(req.stream and req.stream_options and req.stream_options.include_canvas)
        return RequestPlan(rows, seeds, config, keep, constraints, tool_mode, prompt_tokens, ignored, canvas, placed)

    def check_prompt_chars(self, endpoint, req) -> None:
        """A prompt of more characters than the context could hold tokens (~32 characters per token
        at most) is refused before it is tokenised."""
        chars, limit = endpoint.prompt_chars(req), 32 * self.model.args.max_seq_len
        if chars > limit:
            raise APIError(
                400,
                f"{endpoint.prompt_param}: {chars} characters cannot fit the model's context of "
                f"{self.model.args.max_seq_len} tokens",
                param=endpoint.prompt_param,
                code="context_length_exceeded",
            )

    @staticmethod
    def tool_mode(endpoint, req) -> str | None:
        """ "auto": calls parsed from the answer; "forced": the answer is the calls; None: no tools."""
        if not getattr(req, "tools", None) or req.tool_choice == "none":
            return None
        if not endpoint.takes_tools:
            raise APIError(400, "tools: only for /v1/chat/completions", param="tools", code="invalid_value")
        return "auto" if req.tool_choice in (None, "auto") else "forced"

    def constraints(self, req, tool_mode: str | None, rows: int, keep: int) -> list | None:
        """One grammar state per row: forced tool calls, or the response_format; None: free text."""
        stops = self.model.stop_token_ids
        if tool_mode == "forced":
            schema, param = tool_calls.forced_schema(req.tools, req.tool_choice), "tools"

            def make():
                return GrammarConstraint.json(self.tokenizer, stops, schema, what="tools", budget=keep)
        elif getattr(req, "response_format", None) not in (None, {"type": "text"}):
            param = "response_format"

            def make():
                return response_format_constraint(req.response_format, self.tokenizer, stops, budget=keep)
        else:
            return None
        try:
            return [make() for _ in range(rows)]
        except ValueError as e:
            raise APIError(400, str(e), param=param, code="invalid_value") from None

    def submit(self, plan: RequestPlan) -> Job:
        job = Job(
            plan.rows,
            plan.seeds,
            plan.config,
            asyncio.get_running_loop(),
            constraints=plan.constraints,
            canvas=plan.canvas,
            placed=plan.placed,
        )
        sched = self.scheduler
        if sched.never_fits(job):
            mib = sched.kv_cache_bytes / 2**20
            need = sched.kv_bytes(job) / 2**20
            param = "prompt" if sched.kv_bytes(job, answer=False) > sched.kv_cache_bytes else "max_tokens"
            raise APIError(
                400,
                f"{param}: this request's K/V ({need:.1f} MiB for {job.rows} row(s), {job.pages()} pages of "
                f"{plan.config.block_length} positions) "
                f"would never fit the server's --kv-cache-memory ({mib:.1f} MiB); ask for fewer tokens",
                param=param,
                code="kv_cache_exceeded",
            )
        try:
            self.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, str(e), "server_error", code="queue_full") from None
        return job

    async def warm_up(self) -> None:
        """One short decode with the server's defaults (its kernels loaded, a compiled model's graphs
        built), and the chat template compiled; /ready waits for it. It runs beside the scheduler
        and counts as no request."""
        config = self.settings.defaults.with_max_new_tokens(1)
        prompts = [[self.model.args.eos_token_id]]
        try:
            if self.tokenizer.chat_template:
                await asyncio.to_thread(self.tokenizer.encode_chat, [{"role": "user", "content": "warm-up"}])
            await asyncio.to_thread(
                self.commands.run, ("generate", prompts, config, None), generate, self.model, prompts, config=config
            )
        except Exception as e:  # the model cannot decode: say so on /ready, keep serving /health
            log.exception("warm-up failed")
            self.warm_error = f"{type(e).__name__}: {e}"
        self.warmed = True


@dataclass
class RequestPlan:
    """A checked request, ready to queue: one row per choice (prompt x n)."""

    rows: list[list[int]]
    seeds: list[int]
    config: GenerationConfig
    keep: int  # tokens to keep per choice (max_tokens)
    constraints: list | None
    tool_mode: str | None
    prompt_tokens: int
    ignored: list[str]
    canvas: bool = False  # stream each step's canvas (`stream_options.include_canvas`)
    placed: list | None = None  # per row, its images' (columns, soft tokens) (`place_images`)
