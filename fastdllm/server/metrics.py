"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own.

Besides fastdllm's own series, the ones whose meaning is vLLM's carry vLLM's names and its
`model_name` label (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:time_to_first_token_seconds`,
`vllm:e2e_request_latency_seconds`, `vllm:kv_cache_usage_perc`, and the prefix cache's
`vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`, in prompt tokens), so
dashboards built for vLLM read this server unchanged. A diffusion model's first output is its
first finished block: time to first token is the time to that block, and
`fastdllm_time_per_block_seconds` the time between a request's blocks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    def __init__(self, scheduler, model_name: str = "model"):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter(
            "fastdllm_requests", "Requests answered, by route and HTTP status", ["route", "status"], registry=r
        )
        self.latency = Histogram(
            "fastdllm_request_latency_seconds",
            "Time from request to the last byte",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("fastdllm_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generated_tokens = Counter("fastdllm_generated_tokens", "Generated tokens (up to a stop)", registry=r)
        self.batch_rows = Histogram(
            "fastdllm_batch_rows", "Rows decoded together, per block", buckets=BATCH_BUCKETS, registry=r
        )
        self.nfe = Counter("fastdllm_forward_passes", "Model forward passes (NFE)", registry=r)
        queue = Gauge("fastdllm_queue_depth", "Jobs waiting for the inference worker", registry=r)
        queue.set_function(lambda: scheduler.snapshot()["queued"])
        running = Gauge("fastdllm_running_requests", "Jobs in the batch being decoded", registry=r)
        running.set_function(lambda: scheduler.snapshot()["running"])
        label = ["model_name"]
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Generation requests: arrival to the last byte",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to the first finished block",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.block_time = Histogram(
            "fastdllm_time_per_block_seconds",
            "Time between a request's finished blocks",
            label,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.vllm_prompt = Counter("vllm:prompt_tokens", "Prompt tokens of answered requests", label, registry=r)
        self.vllm_generation = Counter("vllm:generation_tokens", "Generated tokens (up to a stop)", label, registry=r)
        # speculative decoding (LinearSpec), as vLLM counts it: drafts verified, draft tokens
        # proposed, draft tokens accepted (the mean acceptance length is 1 + accepted / drafts)
        self.drafts = Counter("vllm:spec_decode_num_drafts", "Drafts verified", label, registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", label, registry=r)
        self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", label, registry=r)
        vllm_running = Gauge("vllm:num_requests_running", "Requests being decoded", label, registry=r)
        vllm_running.labels(model_name).set_function(lambda: scheduler.snapshot()["running"])
        vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for the inference worker", label, registry=r
        )
        vllm_waiting.labels(model_name).set_function(lambda: scheduler.snapshot()["queued"])
        usage = Gauge("vllm:kv_cache_usage_perc", "K/V of the running rows over --kv-cache-memory", label, registry=r)
        usage.labels(model_name).set_function(lambda: _usage(scheduler.snapshot()))
        r.register(PrefixStores(scheduler.kv, model_name))

    def on_block(self, arrival: float, previous: float | None, now: float) -> None:
        """A request's block became final at `now` (its previous one at `previous`)."""
        if previous is None:
            self.ttft.labels(self.model_name).observe(now - arrival)
        else:
            self.block_time.labels(self.model_name).observe(now - previous)

    def on_done(
        self, prompt_tokens: int, generated_tokens: int, seconds: float, acceptances=(), draft_length: int = 0
    ) -> None:
        """A generation request answered in full, `seconds` after it arrived; `acceptances`: what
        each of its speculative verifications accepted (its drafts of `draft_length` tokens kept,
        and its own next token)."""
        if acceptances:
            self.drafts.labels(self.model_name).inc(len(acceptances))
            self.draft_tokens.labels(self.model_name).inc(len(acceptances) * draft_length)
            self.accepted.labels(self.model_name).inc(sum(a - 1 for a in acceptances))
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(generated_tokens)
        self.vllm_prompt.labels(self.model_name).inc(prompt_tokens)
        self.vllm_generation.labels(self.model_name).inc(generated_tokens)
        self.e2e.labels(self.model_name).observe(seconds)

    def on_batch(self, rows: int, nfe: int) -> None:
        self.batch_rows.observe(rows)
        self.nfe.inc(nfe)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _usage(snapshot: dict) -> float:
    budget = snapshot["kv_cache_bytes"]
    return snapshot["kv_bytes_in_use"] / budget if budget else 0.0


class PrefixStores:
    """The scheduler's prefix stores (its `engine.kv.KVRunner`'s), read at each scrape: prompt
    tokens looked up and found (vLLM's names) and the bytes they hold."""

    def __init__(self, kv, model_name: str):
        self.kv, self.model_name = kv, model_name

    def collect(self):
        counted = self.kv.lookups
        label = ["model_name"]
        queries = CounterMetricFamily(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=label
        )
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=label)
        held = GaugeMetricFamily(
            "fastdllm_prefix_cache_bytes", "Bytes of prompt K/V the prefix cache holds", labels=label
        )
        queries.add_metric([self.model_name], counted.queries)
        hits.add_metric([self.model_name], counted.hits)
        held.add_metric([self.model_name], self.kv.prefix_bytes)
        return [queries, hits, held]
