"""Replicas behind one endpoint with Ray Serve: `fastdllm serve --replicas N` (the `fastdllm[ray]`
extra).

Each replica is a Ray actor that loads the model the flags name and runs the same app as
`fastdllm serve` (`create_app`); Ray Serve's proxy is the one HTTP endpoint, routes each request
to a replica, and restarts a replica whose process dies or whose health check fails. The health
check is `Server.broken` (the warm-up failed, the inference worker stopped): what restarting
mends, not a full queue or a warm-up still running, which `/ready` reports besides. Routing,
health checks, restarts and autoscaling are Ray's; nothing here does them.

A request in flight on a replica that dies fails with the proxy's error; the other replicas keep
answering. Replicas are one process each (`--tp` inside a replica is not supported).
"""

from __future__ import annotations

import signal
import threading

DEPLOYMENT = "fastdllm"


def deployment(build, replicas: int, gpu: bool = False, max_ongoing_requests: int = 72):
    """The bound Ray Serve application of `replicas` copies of the server that `build()` makes
    (a picklable callable returning (model, tokenizer, ServerSettings), run in each replica)."""
    from ray import serve

    @serve.deployment(
        name=DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 1, "num_gpus": int(gpu)},  # each replica one CPU, or one GPU
        max_ongoing_requests=max_ongoing_requests,
        health_check_period_s=5,
    )
    @serve.ingress()
    class Replica:
        def __init__(self, build):
            self.model, self.tokenizer, self.settings = build()
            self.server = None  # (`app` is Ray's name for the ASGI app)

        def __serve_build_asgi_app__(self):
            from .app import create_app

            app = create_app(self.model, self.tokenizer, self.settings)
            self.server = app.state.server
            return app

        def check_health(self) -> None:
            reason = None if self.server is None else self.server.broken()
            if reason is not None:
                raise RuntimeError(reason)

    return Replica.bind(build)


def serve_replicas(app, host: str, port: int) -> None:
    """Start Ray (a local cluster, or the one RAY_ADDRESS names) and serve `app` (`deployment`)
    on host:port until SIGINT / SIGTERM, then shut it down."""
    import ray
    from ray import serve

    ray.init(include_dashboard=False, logging_level="warning")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(app, name=DEPLOYMENT, route_prefix="/")
        print(f"fastdllm serve: replicas on http://{host}:{port}/v1 (Ray Serve)", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
