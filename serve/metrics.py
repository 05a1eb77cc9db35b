"""Prometheus metrics of a running server (vLLM's names, under the `lathe:` prefix).

Engine state — requests running and waiting, KV-cache usage, prefix-cache queries and
hits, preemptions, prompt and generation tokens, and under speculative decoding the draft
tokens proposed and accepted — is the engine core's last report (`LLMEngine.stats()`, sent
with its output at most every 50 ms while it is busy and once when it goes idle); latency
histograms (time to first token, inter-token latency, end-to-end) are observed by the
server as each request streams.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, float] | None], model: str) -> None:
        self.stats, self.model = stats, model

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.stats()
        if stats is None:
            return
        for name, key, help_ in (
                ("num_requests_running", "num_running", "Sequences in the running batch."),
                ("num_requests_waiting", "num_waiting", "Sequences waiting to be admitted."),
                ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV blocks in use."),
                ("weight_bytes", "weight_bytes", "Bytes of the weights as served."),
                ("kv_cache_bytes", "kv_cache_bytes", "Bytes of the KV cache slabs.")):
            gauge = GaugeMetricFamily(f"lathe:{name}", help_, labels=["model_name"])
            gauge.add_metric([self.model], stats[key])
            yield gauge
        for name, key, help_ in (
                ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up."),
                ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found cached."),
                ("num_preemptions", "num_preemptions", "Sequences preempted by recompute."),
                ("prompt_tokens", "prompt_tokens", "Prompt tokens received."),
                ("generation_tokens", "generation_tokens", "Tokens generated.")):
            counter = CounterMetricFamily(f"lathe:{name}", help_, labels=["model_name"])
            counter.add_metric([self.model], stats[key])
            yield counter
        if "recurrent_snapshots" in stats:
            gauge = GaugeMetricFamily(
                "lathe:recurrent_snapshots", "Linear-attention states kept for the prefix "
                "cache (a model with linear-attention layers).", labels=["model_name"])
            gauge.add_metric([self.model], stats["recurrent_snapshots"])
            yield gauge
        if "decode_graphs_late" in stats:
            counter = CounterMetricFamily(
                "lathe:decode_graphs_built", "Compiled decode steps built, by origin: "
                "compiled or loaded from the cache (at warm-up or in the background).",
                labels=["model_name", "origin"])
            counter.add_metric([self.model, "compiled"], stats["decode_graphs_compiled"])
            counter.add_metric([self.model, "cached"], stats["decode_graphs_cached"])
            yield counter
            late = CounterMetricFamily("lathe:decode_graphs_late", "Compiled decode steps "
                                       "built after warm-up (each a compile under load).",
                                       labels=["model_name"])
            late.add_metric([self.model], stats["decode_graphs_late"])
            yield late
            pending = GaugeMetricFamily("lathe:decode_graphs_pending", "Compiled decode "
                                        "steps still being built in the background (their "
                                        "batch sizes run eager meanwhile).",
                                        labels=["model_name"])
            pending.add_metric([self.model], stats["decode_graphs_pending"])
            yield pending
            failed = GaugeMetricFamily("lathe:decode_graphs_failed", "1 once building the "
                                       "compiled decode steps in the background failed (the "
                                       "batch sizes not built by then run eager; the log "
                                       "says why).", labels=["model_name"])
            failed.add_metric([self.model], stats["decode_graphs_failed"])
            yield failed
        if "spec_decode_num_drafts" in stats:
            yield from self._speculation(stats)

    def _speculation(self, stats: dict[str, float],
                     ) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        for name, help_ in (
                ("spec_decode_num_drafts", "Decode steps of a sequence that verified drafts."),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.")):
            counter = CounterMetricFamily(f"lathe:{name}", help_, labels=["model_name"])
            counter.add_metric([self.model], stats[name])
            yield counter
        for name, help_ in (
                ("spec_decode_acceptance_rate", "Accepted / proposed draft tokens."),
                ("spec_decode_mean_acceptance_length",
                 "Tokens a drafting step emits on average (accepted drafts + 1).")):
            gauge = GaugeMetricFamily(f"lathe:{name}", help_, labels=["model_name"])
            gauge.add_metric([self.model], stats[name])
            yield gauge


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, float] | None], model: str) -> None:
        """`stats`: the engine's counters now (`LLMEngine.stats()`), None before it runs."""
        self.registry = CollectorRegistry()
        self.model = model
        self.registry.register(_EngineCollector(stats, model))

        def histogram(name: str, help_: str) -> Histogram:
            return Histogram(f"lathe:{name}", help_, ["model_name"], registry=self.registry,
                             buckets=LATENCY_BUCKETS).labels(model)
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time from request to its first token.")
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between consecutive tokens of a sequence.")
        self.e2e_latency = histogram("e2e_request_latency_seconds",
                                     "Time from request to its last token.")
        self.adapter_requests = Counter(
            "lathe:lora_requests", "Requests served on each LoRA adapter.",
            ["model_name", "lora_name"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Feeds one request's token arrivals into the latency histograms."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first: float | None = None
        self.last: dict[int, float] = {}  # per sequence index

    def token(self, index: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.time_to_first_token.observe(now - self.start)
        if index in self.last:
            self.metrics.inter_token_latency.observe(now - self.last[index])
        self.last[index] = now

    def done(self) -> None:
        self.metrics.e2e_latency.observe(time.perf_counter() - self.start)
