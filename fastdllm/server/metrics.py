"""Prometheus metrics of one server (`GET /metrics`), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class ServerMetrics:
    def __init__(self, scheduler):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("fastdllm_requests", "Requests answered, by route and HTTP status",
                                ["route", "status"], registry=r)
        self.latency = Histogram("fastdllm_request_latency_seconds", "Time from request to the last byte",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("fastdllm_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.generated_tokens = Counter("fastdllm_generated_tokens", "Generated tokens (up to a stop)", registry=r)
        self.batch_rows = Histogram("fastdllm_batch_rows", "Rows decoded together, per block", buckets=BATCH_BUCKETS,
                                    registry=r)
        self.nfe = Counter("fastdllm_forward_passes", "Model forward passes (NFE)", registry=r)
        queue = Gauge("fastdllm_queue_depth", "Jobs waiting for the inference worker", registry=r)
        queue.set_function(lambda: scheduler.snapshot()["queued"])
        running = Gauge("fastdllm_running_requests", "Jobs in the batch being decoded", registry=r)
        running.set_function(lambda: scheduler.snapshot()["running"])

    def on_batch(self, rows: int, nfe: int) -> None:
        self.batch_rows.observe(rows)
        self.nfe.inc(nfe)

    def render(self) -> bytes:
        return generate_latest(self.registry)
