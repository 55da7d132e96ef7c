"""From a queued job to the response: the two completion endpoints, the one envelope every
response body is built in, and `Answer`, which feeds finished blocks to the choices and returns
the whole body or streams it."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from ..engine.likelihood import prefix_logprobs
from ..text import tool_calls
from .incremental import ChoiceText
from .scheduler import BlockFinal, CanvasStep, Job, JobEnded, JobFailed
from .schema import APIError, ChatCompletionRequest, CompletionRequest
from .state import RequestPlan, Server


class ChatEndpoint:
    """/v1/chat/completions: what differs from /v1/completions, in one place."""

    request_model = ChatCompletionRequest
    id_prefix, object, chunk_object, prompt_param = "chatcmpl", "chat.completion", "chat.completion.chunk", "messages"
    opens_with_role = takes_tools = True

    @staticmethod
    def max_tokens(req):
        return req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens

    @staticmethod
    def prompts(server, req):
        return [server.chat_prompt(req)]

    @staticmethod
    def prompt_chars(req) -> int:
        return sum(len(m.text()) for m in req.messages)

    @staticmethod
    def choice(i, ch, calls=None, logprobs=None) -> dict:
        """`calls`: (content, OpenAI tool_calls) when the answer called tools."""
        message = {"role": "assistant", "content": ch.text}
        finish = ch.finish_reason
        if calls:
            message = {"role": "assistant", "content": calls[0], "tool_calls": calls[1]}
            finish = "tool_calls"
        return {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def chunk_choice(i, delta, finish, role=False, calls=None, logprobs=None) -> dict:
        d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
        if calls:
            d = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
        return {"index": i, "delta": d, "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(tokens: list[str], entries: list, text_of, offset: int = 0) -> dict:
        """OpenAI's chat `logprobs`: per token its text, log-probability (None for a token no
        forward chose: a fixed one), UTF-8 bytes and top tokens."""

        def item(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = [
            {**item(t, e[0] if e else None), "top_logprobs": [item(text_of(a), b) for a, b in (e[1] if e else [])]}
            for t, e in zip(tokens, entries)
        ]
        return {"content": content, "refusal": None}


class CompletionEndpoint:
    """/v1/completions."""

    request_model = CompletionRequest
    id_prefix, object, chunk_object, prompt_param = "cmpl", "text_completion", "text_completion", "prompt"
    opens_with_role = takes_tools = False

    @staticmethod
    def max_tokens(req):
        return req.max_tokens

    @staticmethod
    def prompts(server, req):
        return server.completion_prompts(req)

    @staticmethod
    def prompt_chars(req) -> int:
        p = req.prompt
        return len(p) if isinstance(p, str) else sum(len(x) if isinstance(x, (str, list)) else 1 for x in p)

    @staticmethod
    def choice(i, ch, logprobs=None) -> dict:
        return {"index": i, "text": ch.text, "logprobs": logprobs, "finish_reason": ch.finish_reason}

    @staticmethod
    def chunk_choice(i, delta, finish, role=False, logprobs=None) -> dict:
        return {"index": i, "text": delta or "", "logprobs": logprobs, "finish_reason": finish}

    @staticmethod
    def logprobs(tokens: list[str], entries: list, text_of, offset: int = 0) -> dict:
        """OpenAI's completions `logprobs`: tokens, their log-probabilities (None for a token no
        forward chose: a fixed one), the top tokens per position, each token's offset in the text."""
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e[0] if e else None for e in entries],
            "top_logprobs": [{text_of(a): b for a, b in e[1]} if e else None for e in entries],
            "text_offset": offsets,
        }


def _usage(prompt_tokens: int, completion_tokens: int, acceptances: list[list[int]] | None = None) -> dict:
    """OpenAI's usage; with a speculative decoder's verifications (per choice, what each accepted),
    `speculation`: their count, the tokens they accepted (each its kept drafts and its own next
    token) and the mean acceptance length."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    lengths = [a for choice in acceptances or () for a in choice]
    if lengths:
        usage["speculation"] = {
            "verifications": len(lengths),
            "accepted_tokens": sum(lengths),
            "mean_acceptance_length": round(sum(lengths) / len(lengths), 4),
        }
    return usage


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


_OMIT = object()


def envelope(meta: dict, object: str, choices: list, usage=_OMIT) -> dict:
    """Every response body and chunk: id, created and model (`meta`), object, choices, usage."""
    body = {**meta, "object": object, "system_fingerprint": None, "choices": choices}
    if usage is not _OMIT:
        body["usage"] = usage
    return body


def new_meta(prefix: str, model_name: str) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex[:24]}", "created": int(time.time()), "model": model_name}


class Answer:
    """One request's decode, from its queued job to its response: the choices' incremental text,
    the tool calls parsed from a finished choice, and the whole body or the event stream."""

    def __init__(self, server: Server, endpoint, req, request: Request, plan: RequestPlan, arrival: float):
        self.server, self.endpoint, self.req, self.request, self.plan = server, endpoint, req, request, plan
        self.arrival, self.last_block_at = arrival, None
        tokenizer, model = server.tokenizer, server.model
        self.choices = [
            ChoiceText(tokenizer, model.stop_token_ids, req.stop_list(), plan.keep, plan.config.fixed_end)
            for _ in plan.rows
        ]
        self.job: Job = server.submit(plan)
        self.meta = new_meta(endpoint.id_prefix, server.served_name(req.model))
        self.include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        parser = server.settings.tool_call_parser or tool_calls.parser_for_template(tokenizer.chat_template)
        self.parse = tool_calls.PARSERS[parser]
        ignored = plan.ignored
        self.token_texts: dict[int, str] = {}
        self.wants_logprobs = plan.config.logprobs is not None
        self.logprobs_sent = [0] * len(self.choices)  # per choice: tokens whose logprobs were sent
        self.text_sent = [0] * len(self.choices)  # per choice: characters of those tokens
        self.headers = {"X-Fastdllm-Ignored": ", ".join(ignored)} if ignored else {}
        self.acceptances: list[list[int]] | None = None  # per choice, its verifications' (LinearSpec)

    # -- the choices
    def usage(self) -> dict:
        return _usage(self.plan.prompt_tokens, sum(ch.num_tokens for ch in self.choices), self.acceptances)

    def on_block(self, item: BlockFinal) -> list[tuple[int, str, bool]]:
        """Feed a block to every choice: [(index, new text, became final)]."""
        now = time.perf_counter()
        self.server.metrics.on_block(self.arrival, self.last_block_at, now)
        self.last_block_at = now
        if item.acceptances is not None:
            self.acceptances = item.acceptances
        out = []
        for i, ch in enumerate(self.choices):
            if not ch.final:
                logprobs = None if item.logprobs is None else item.logprobs[i]
                delta = ch.feed(item.tokens[i], item.finished[i], item.last[i], logprobs)
                out.append((i, delta, ch.final))
        if all(ch.final for ch in self.choices):
            self.job.satisfied = True
        return out

    def finish_all(self) -> list[tuple[int, str, bool]]:
        return [(i, ch.feed([], False, True), True) for i, ch in enumerate(self.choices) if not ch.final]

    def calls_of(self, ch) -> tuple[str | None, list[dict]] | None:
        """(content, OpenAI tool_calls) of a finished choice that called tools, else None."""
        mode = self.plan.tool_mode
        if mode is None:
            return None
        if mode == "forced":
            content, found = None, tool_calls.forced_calls(ch.text, self.req.tool_choice)
        else:
            content, found = self.parse(ch.text)
        return (content, tool_calls.openai_calls(found)) if found else None

    def done(self) -> None:
        self.server.metrics.on_done(
            self.plan.prompt_tokens,
            sum(ch.num_tokens for ch in self.choices),
            time.perf_counter() - self.arrival,
            [a for choice in self.acceptances or () for a in choice],
            self.plan.config.window_size - 1,
        )

    async def events(self, watch_disconnect: bool):
        """The job's events; when not streaming, checks every second that the client is still there."""
        job = self.job
        while True:
            if watch_disconnect:
                try:
                    item = await asyncio.wait_for(job.events.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await self.request.is_disconnected():
                        self.server.scheduler.cancel(job)
                        return
                    continue
            else:
                item = await job.events.get()
            yield item
            if isinstance(item, (JobEnded, JobFailed)):
                return

    # -- the whole body
    async def whole(self) -> JSONResponse:
        ended = False
        try:
            async for item in self.events(watch_disconnect=True):
                if isinstance(item, JobFailed):
                    ended = True
                    raise item.error
                if isinstance(item, JobEnded):
                    ended = True
                elif isinstance(item, BlockFinal):
                    self.on_block(item)
                    if self.job.satisfied:
                        ended = True
                        break
            if not ended:  # the client went away while waiting
                return JSONResponse({}, status_code=499)
            self.finish_all()
        finally:
            if not ended:
                self.server.scheduler.cancel(self.job)
        self.done()
        endpoint, tools = self.endpoint, self.plan.tool_mode is not None
        choices = [
            endpoint.choice(i, ch, self.calls_of(ch), logprobs=self.new_logprobs(i, always=True))
            if tools
            else endpoint.choice(i, ch, logprobs=self.new_logprobs(i, always=True))
            for i, ch in enumerate(self.choices)
        ]
        return JSONResponse(envelope(self.meta, endpoint.object, choices, self.usage()), headers=self.headers)

    # -- the stream
    def chunk(self, choice: dict) -> str:
        usage = None if self.include_usage else _OMIT
        return _sse(envelope(self.meta, self.endpoint.chunk_object, [choice], usage))

    def text_chunk(self, i: int, delta: str | None, finish: str | None, role: bool = False) -> str:
        logprobs = self.new_logprobs(i) if delta or finish else None
        return self.chunk(self.endpoint.chunk_choice(i, delta, finish, role, logprobs=logprobs))

    def new_logprobs(self, i: int, always: bool = False) -> dict | None:
        """The endpoint's `logprobs` of choice i's tokens that its sent text now holds whole and
        that were not sent yet (all of its answer's, once final); None when not asked for, or
        (unless `always`: a whole body's, however empty) when no token is new."""
        if not self.wants_logprobs:
            return None
        ch, start = self.choices[i], self.logprobs_sent[i]
        end = ch.tokens_sent()
        if end == start and not always:
            return None
        tokens = [self.token_text(t) for t in ch.ids[start:end]]
        if ch.final and ch.partial and end > start:  # the text ends inside its last token: that part
            tokens[-1] = ch.text[self.text_sent[i] + sum(map(len, tokens[:-1])) :]
        out = self.endpoint.logprobs(tokens, ch.logprobs[start:end], self.token_text, self.text_sent[i])
        self.logprobs_sent[i], self.text_sent[i] = end, self.text_sent[i] + sum(map(len, tokens))
        return out

    def canvas_chunks(self, item: CanvasStep) -> list[str]:
        """A step's canvas, one `event: canvas` chunk per choice: no choices (a client that did not
        ask never sees one; the official clients read it as a chunk without choices), and under
        `canvas` the answer region's tokens as text (the mask as the model's mask text), the
        positions the step revealed and edited, the block, and the forwards so far."""
        out = []
        for i, ids, revealed, edited, block, nfe in item.rows:
            canvas = {
                "index": i,
                "tokens": [self.token_text(t) for t in ids[: self.plan.keep]],
                "revealed": [p for p in revealed if p < self.plan.keep],
                "edited": [p for p in edited if p < self.plan.keep],
                "block": block,
                "nfe": nfe,
            }
            body = {**envelope(self.meta, self.endpoint.chunk_object, []), "canvas": canvas}
            out.append(f"event: canvas\n{_sse(body)}")
        return out

    def token_text(self, t: int) -> str:
        if t not in self.token_texts:
            self.token_texts[t] = self.server.tokenizer.decode([t], skip_special_tokens=False)
        return self.token_texts[t]

    def render(self, updates) -> list[str]:
        """The chunks for a block's updates. A tool-calling answer is sent whole once final: the
        calls, or its text when it called none."""
        out = []
        for i, delta, became_final in updates:
            ch = self.choices[i]
            if self.plan.tool_mode is None:
                if delta:
                    out.append(self.text_chunk(i, delta, None))
                if became_final:
                    out.append(self.text_chunk(i, None, ch.finish_reason))
                continue
            if not became_final:
                continue
            calls = self.calls_of(ch)
            if calls is None:
                if ch.text:
                    out.append(self.text_chunk(i, ch.text, None))
                out.append(self.text_chunk(i, None, ch.finish_reason))
                continue
            if calls[0]:
                out.append(self.text_chunk(i, calls[0], None))
            out.append(self.chunk(self.endpoint.chunk_choice(i, None, None, calls=calls[1])))
            out.append(self.text_chunk(i, None, "tool_calls"))
        return out

    async def chunks(self):
        done = False
        try:
            if self.endpoint.opens_with_role:
                for i in range(len(self.choices)):
                    yield self.text_chunk(i, None, None, role=True)
            async for item in self.events(watch_disconnect=False):
                if isinstance(item, JobFailed):
                    yield _sse(item.error.body())
                    yield "data: [DONE]\n\n"
                    done = True
                    return
                if isinstance(item, CanvasStep):
                    for s in self.canvas_chunks(item):
                        yield s
                if isinstance(item, BlockFinal):
                    for s in self.render(self.on_block(item)):
                        yield s
                    if self.job.satisfied:
                        break
            for s in self.render(self.finish_all()):
                yield s
            if self.include_usage:
                yield _sse(envelope(self.meta, self.endpoint.chunk_object, [], self.usage()))
            yield "data: [DONE]\n\n"
            done = True
            self.done()
        finally:
            if not done:  # the client went away (the response task was cancelled)
                self.server.scheduler.cancel(self.job)

    def stream(self) -> StreamingResponse:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **self.headers}
        return StreamingResponse(self.chunks(), media_type="text/event-stream", headers=headers)


async def answer(server: Server, endpoint, req, request: Request):
    """A completion request, answered whole or streamed."""
    arrival = time.perf_counter()
    plan = await asyncio.to_thread(server.plan, endpoint, req)  # tokenising and grammars off the event loop
    reply = Answer(server, endpoint, req, request, plan, arrival)
    return reply.stream() if req.stream else await reply.whole()


async def score(server: Server, req: CompletionRequest) -> JSONResponse:
    """echo + logprobs: each prompt token's log-probability given the tokens before it (the later
    ones masked; `likelihood.prefix_logprobs`), and with max_tokens 1 the next token, in
    OpenAI's completions `logprobs` layout, as lm-eval's local-completions reads it."""
    arrival = time.perf_counter()
    model, tokenizer = server.model, server.tokenizer
    server.check_model(req.model)
    req.check_unsupported(server.settings.strict)
    prompts = await asyncio.to_thread(server.completion_prompts, req)
    extra = req.max_tokens or 0
    for p in prompts:
        if len(p) + extra > model.args.max_seq_len:
            raise APIError(
                400,
                f"prompt: {len(p)} tokens exceed the model's context of {model.args.max_seq_len}",
                param="prompt",
                code="context_length_exceeded",
            )

    top = max(1, req.logprobs)

    adapter = None
    if req.model in server.settings.adapters:  # every token scored under the adapter the request names
        adapter = model.lora.index(req.model)

    def each():
        with model.adapted(adapter):
            return [prefix_logprobs(model, p, top=top, extra=extra) for p in prompts]

    def compute():
        with server.scoring_lock:
            return server.commands.run(("score", prompts, top, extra), each)

    def piece(t: int) -> str:
        return tokenizer.decode([t], skip_special_tokens=False)

    choices = []
    for i, (toks, lps, tops) in enumerate(await asyncio.to_thread(compute)):
        pieces = [piece(t) for t in toks]
        offsets = [sum(len(x) for x in pieces[:k]) for k in range(len(pieces))]
        top = [None if t is None else {piece(a): b for a, b in t[: req.logprobs]} for t in tops]
        logprobs = {"tokens": pieces, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}
        choices.append({"index": i, "text": "".join(pieces), "finish_reason": "length", "logprobs": logprobs})
    prompt_tokens = sum(len(p) for p in prompts)
    server.metrics.on_done(prompt_tokens, extra * len(prompts), time.perf_counter() - arrival)
    meta = new_meta("cmpl", server.served_name(req.model))
    return JSONResponse(envelope(meta, "text_completion", choices, _usage(prompt_tokens, extra * len(prompts))))
