"""Prometheus metrics of the entry: the whole cluster at a glance (each worker keeps its own /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

FORWARD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.8, 1.2, 2.0, 5.0, 10.0)


class EntryMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.workers = Gauge("lychee_rtc_cluster_workers", "Workers by state", ["state"], registry=r)
        self.capacity = Gauge("lychee_rtc_cluster_capacity", "Session slots of the ready workers", registry=r)
        self.free = Gauge("lychee_rtc_cluster_free_slots", "Free session slots of the ready workers", registry=r)
        self.active = Gauge("lychee_rtc_cluster_active_sessions", "Sessions on the workers", registry=r)
        self.worker_up = Gauge("lychee_rtc_cluster_worker_up", "1 when the worker takes calls", ["worker"],
                               registry=r)
        self.worker_free = Gauge("lychee_rtc_cluster_worker_free_slots", "Free slots per worker", ["worker"],
                                 registry=r)
        self.worker_active = Gauge("lychee_rtc_cluster_worker_active_sessions", "Sessions per worker", ["worker"],
                                   registry=r)
        self.worker_failures = Counter("lychee_rtc_cluster_worker_failures_total",
                                       "Times a worker stopped answering", ["worker"], registry=r)
        self.worker_restarts = Counter("lychee_rtc_cluster_worker_restarts_total",
                                       "New worker processes seen (Ray restarts and rolling restarts)", ["worker"],
                                       registry=r)
        self.offers = Counter("lychee_rtc_cluster_offers_total", "Offers by outcome", ["outcome"], registry=r)
        self.forward_seconds = Histogram("lychee_rtc_cluster_forward_seconds",
                                         "Time a request spent at its worker, seen from the entry", ["kind"],
                                         buckets=FORWARD_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
