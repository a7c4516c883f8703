"""Prometheus metrics of one server (its own registry, so several servers can live in one process).

The job mechanism (serve/jobs.py) reports every route in one family labelled by ``route``: ``omni_accel_jobs_total
{route, outcome}``, ``omni_accel_jobs_queued{route}``, ``omni_accel_jobs_running{route}``,
``omni_accel_job_wait_seconds{route}`` and ``omni_accel_job_run_seconds{route}``. The older unlabelled gauges
(``omni_accel_queue_depth``, ``omni_accel_speech_queue_depth`` ...) and the totals over routes
(``omni_accel_cancelled_requests_total``, ``omni_accel_rejected_requests_total``) stay for existing dashboards."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
KNOWN_PATHS = ("/v1/images/generations", "/v1/images/edits", "/v1/audio/speech", "/v1/audio/voices", "/v1/models",
               "/v1/videos", "/health", "/metrics")


class ServeMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("omni_accel_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("omni_accel_request_latency_seconds", "HTTP request latency by endpoint",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.queue_depth = Gauge("omni_accel_queue_depth", "requests waiting for the worker", registry=r)
        self.running = Gauge("omni_accel_running_requests", "requests in the pipeline call now", registry=r)
        self.pipeline_calls = Counter("omni_accel_pipeline_calls", "pipeline calls (batches)", registry=r)
        self.batch_requests = Histogram("omni_accel_batch_requests", "requests per pipeline call",
                                        buckets=(1, 2, 3, 4, 6, 8, 12, 16), registry=r)
        self.images = Counter("omni_accel_images_generated", "images generated", registry=r)
        self.pipeline_seconds = Histogram("omni_accel_pipeline_call_seconds", "duration of one pipeline call",
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.forwards = Counter("omni_accel_transformer_forwards",
                                "transformer forwards run (from pipe.omni_accel.report())", registry=r)
        self.forwards_saved = Counter("omni_accel_transformer_forwards_saved",
                                      "transformer forwards whose blocks a step cache reused instead of running "
                                      "(report()['cache']['reused'])", registry=r)
        self.cancelled = Counter("omni_accel_cancelled_requests", "requests cancelled (client gone or timeout)",
                                 ["stage", "reason"], registry=r)
        self.rejected = Counter("omni_accel_rejected_requests", "requests refused with 429 (queue full)",
                                registry=r)
        self.jobs = Counter("omni_accel_jobs", "jobs by route and outcome (completed, failed, cancelled, rejected)",
                            ["route", "outcome"], registry=r)
        self.jobs_queued = Gauge("omni_accel_jobs_queued", "jobs waiting for their model's worker", ["route"],
                                 registry=r)
        self.jobs_running = Gauge("omni_accel_jobs_running", "jobs in a pipeline call now", ["route"], registry=r)
        self.job_wait = Histogram("omni_accel_job_wait_seconds", "seconds from admission to the start of the job's "
                                  "call", ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.job_run = Histogram("omni_accel_job_run_seconds", "seconds of the pipeline call a job ran in",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=r)
        self.speech_queue_depth = Gauge("omni_accel_speech_queue_depth", "speech requests waiting", registry=r)
        self.speech_running = Gauge("omni_accel_speech_running_requests", "speech requests generating now",
                                    registry=r)
        self.speech_stream_errors = Counter("omni_accel_speech_stream_errors",
                                            "speech streams that failed after their 200 header (SSE error event or "
                                            "cut PCM stream)", ["code"], registry=r)

    @staticmethod
    def endpoint(path: str) -> str:
        if path in KNOWN_PATHS:
            return path
        if path.startswith("/v1/images/files/"):
            return "/v1/images/files"
        if path.startswith("/v1/videos/"):  # one label per route, not per video id
            return "/v1/videos/{id}/content" if path.endswith("/content") else "/v1/videos/{id}"
        return "other"

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        ep = self.endpoint(path)
        self.requests.labels(ep, str(status)).inc()
        self.latency.labels(ep).observe(seconds)

    def observe_batch(self, model, requests: int, images: int, seconds: float) -> None:
        self.pipeline_calls.inc()
        self.batch_requests.observe(requests)
        self.images.inc(images)
        self.pipeline_seconds.observe(seconds)
        state = vars(model.pipe).get("omni_accel")
        if state is not None and state.last_call is not None:
            self.forwards.inc(state.last_call.transformer_forwards)
            # tea_cache reports its reused forwards; cache_dit / fb_cache keep their step decisions to themselves
            cache = state.report().get("cache") or {}
            self.forwards_saved.inc(int(cache.get("reused") or 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
