"""Prometheus metrics of a server, with vLLM's names and meanings so its dashboards work.

Each server owns a ``CollectorRegistry`` (not prometheus_client's global one), so several servers
can run in one process (tests do). Every metric carries the ``model_name`` label, as vLLM's do.
Counters are exposed with the ``_total`` suffix (``vllm:prompt_tokens_total``), as vLLM's are;
the process's own metrics (``process_resident_memory_bytes``, ...) are there too.

Request metrics are observed in the API process (``verispec.serve.async_engine``) when a step's
tokens arrive from the engine process: time to first token from the request's arrival at the
server, inter-token latency between two successive arrivals of new tokens (a speculative step
may deliver several at once, as in vLLM), end-to-end latency when it finishes; token counts are
those the responses report (a stop string ends a request's tokens). The gauges and speculative
counters are the engine's, sent with every step. Speculative decoding counters follow
docs/design.md §8.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector

from verispec.engine.metrics import SpecDecodingStats

# Bucket bounds in seconds, as vLLM's.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """The metrics of one server, in their own registry (``registry``).

    Parameters
    ----------
    model_name : the served model name (the ``model_name`` label)
    num_kv_slots : request slots of the engine (``max_num_seqs``)
    num_spec_tokens : k, or 0 without speculation (no speculative metrics then, as vLLM)
    """

    def __init__(self, model_name: str, num_kv_slots: int, num_spec_tokens: int = 0) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.num_kv_slots = num_kv_slots
        labels = {"model_name": model_name}

        def make(kind, name, documentation, **kwargs):
            metric = kind(name, documentation, labelnames=list(labels), registry=self.registry,
                          **kwargs)
            return metric.labels(**labels)

        self.num_requests_running = make(
            Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = make(
            Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_slots_in_use = make(
            Gauge, "verispec:kv_slots_in_use",
            "KV cache slots held by requests (one per running request).")
        self.kv_cache_usage = make(
            Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # exposed as vllm:num_preemptions_total
        self.num_preemptions = make(
            Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self._preemptions_seen = 0
        # exposed as vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total (tokens)
        self.prefix_cache_queries = make(
            Counter, "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = make(
            Counter, "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.")
        self._prefix_seen = (0, 0)
        self.prompt_tokens = make(
            Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(
            Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.time_to_first_token = make(
            Histogram, "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.", buckets=TTFT_BUCKETS)
        self.inter_token_latency = make(
            Histogram, "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.", buckets=ITL_BUCKETS)
        self.e2e_request_latency = make(
            Histogram, "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", buckets=E2E_BUCKETS)
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labelnames=[*labels, "finished_reason"], registry=self.registry)
        # One child per reason up front, so a dashboard sees zeros rather than no series.
        self.request_success = {reason: success.labels(**labels, finished_reason=reason)
                                for reason in FINISH_REASONS}
        self.num_spec_tokens = num_spec_tokens
        self._spec_seen = SpecDecodingStats(max(num_spec_tokens, 1))
        if num_spec_tokens:
            self.spec_num_drafts = make(
                Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts.")
            self.spec_num_draft_tokens = make(
                Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens.")
            self.spec_num_accepted_tokens = make(
                Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.")
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                              "Accepted tokens per draft position.",
                              labelnames=[*labels, "position"], registry=self.registry)
            self.spec_accepted_per_pos = [per_pos.labels(**labels, position=str(i))
                                          for i in range(num_spec_tokens)]

    def set_queue(self, num_running: int, num_waiting: int, num_kv_slots_in_use: int,
                  kv_cache_usage: float = 0.0, num_preemptions: int = 0,
                  prefix_cache_queries: int = 0, prefix_cache_hits: int = 0) -> None:
        """The scheduler's state: queue lengths, slots in use, the fraction of KV blocks in use
        and its running counts of preemptions and of prefix-cache tokens queried and found."""
        self.num_requests_running.set(num_running)
        self.num_requests_waiting.set(num_waiting)
        self.kv_slots_in_use.set(num_kv_slots_in_use)
        self.kv_cache_usage.set(kv_cache_usage)
        self.num_preemptions.inc(num_preemptions - self._preemptions_seen)
        self._preemptions_seen = num_preemptions
        queries, hits = self._prefix_seen
        self.prefix_cache_queries.inc(prefix_cache_queries - queries)
        self.prefix_cache_hits.inc(prefix_cache_hits - hits)
        self._prefix_seen = (prefix_cache_queries, prefix_cache_hits)

    def observe_spec(self, total: SpecDecodingStats) -> None:
        """Advance the speculative counters to the engine's running totals ``total``."""
        if not self.num_spec_tokens:
            return
        seen = self._spec_seen
        self.spec_num_drafts.inc(total.num_drafts - seen.num_drafts)
        self.spec_num_draft_tokens.inc(total.num_draft_tokens - seen.num_draft_tokens)
        self.spec_num_accepted_tokens.inc(total.num_accepted_tokens - seen.num_accepted_tokens)
        for child, now, before in zip(self.spec_accepted_per_pos,
                                      total.num_accepted_tokens_per_pos,
                                      seen.num_accepted_tokens_per_pos):
            child.inc(now - before)
        self._spec_seen = SpecDecodingStats(total.num_spec_tokens)
        self._spec_seen.merge(total)
