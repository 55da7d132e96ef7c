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
The thread takes the oldest job plus any other queued jobs whose forwards can be shared
(`engine.rows.shares_forwards`: thresholds, steps, temperatures, lengths and decoders may differ,
block lengths where the model's attention allows, as Nemotron-Labs-Diffusion's three modes; up to
--max-batch-size rows) and decodes them step by step, every row on its own clock, with per-row
seeds: a job that arrives later joins at the next step, and a row leaves as soon as it is done.
Each row decodes with its own settings and random stream, as alone (the dense math's row count can
move a logit by float rounding, which can flip a near-tie; `--deterministic` rules that out). A
full queue answers 503. A job whose client went away is dropped from the queue, and its rows leave
a running batch after the step in flight.

Errors come in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, HTTP 400 for a bad
request (malformed JSON, wrong types, unknown fields, out-of-range values, a prompt beyond the
context), 404 for an unknown route or model, 503 when the queue is full.

Where things are: `schema` (request bodies, errors), `scheduler` (queue, inference thread),
`incremental` (streamed text), `state` (a request read into rows and a config), `responses`
(a job's answer, whole or streamed), `app` (routes); the command `fastdllm serve` is
`fastdllm.cli.serve`.
"""

from __future__ import annotations

from .app import create_app
from .incremental import ChoiceText
from .scheduler import Job, QueueFull, Scheduler
from .schema import DLLM_FIELDS, MAX_N, MAX_STOP, APIError, ChatCompletionRequest, CompletionRequest
from .state import Server, ServerSettings, default_model_names

__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChoiceText",
    "CompletionRequest",
    "DLLM_FIELDS",
    "Job",
    "MAX_N",
    "MAX_STOP",
    "QueueFull",
    "Scheduler",
    "Server",
    "ServerSettings",
    "create_app",
    "default_model_names",
]
