"""Serving samples from the catalogue over HTTP for Prometheus.

A process hands :func:`serve` a function that reads its live counters and returns
``{metric name: [(label values, value), ...]}`` (for a summary the value is
``(sum, count)``). It runs at scrape time in the HTTP server's thread, so the hot
paths pay nothing for metrics.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from shadow.metrics.catalog import Metric

logger = logging.getLogger(__name__)

Samples = dict[str, list[tuple[tuple[str, ...], object]]]
_FAMILY = {"gauge": GaugeMetricFamily, "counter": CounterMetricFamily, "summary": SummaryMetricFamily}


class _Collector:
    def __init__(self, metrics: Iterable[Metric], read: Callable[[], Samples]) -> None:
        self.metrics, self.read = tuple(metrics), read

    def _read(self) -> Samples:
        for _ in range(3):  # the owner may resize a dict while this thread iterates it
            try:
                return self.read()
            except RuntimeError:
                continue
        return self.read()

    def collect(self):
        try:
            samples = self._read()
        except Exception:  # a broken reader must not take the endpoint down
            logger.exception("metrics: reading the samples failed")
            samples = {}
        for m in self.metrics:
            fam = _FAMILY[m.kind](m.name, m.help, labels=list(m.labels))
            for labels, value in samples.get(m.name, ()):
                if m.kind == "summary":
                    total, count = value
                    fam.add_metric(list(labels), count_value=count, sum_value=total)
                else:
                    fam.add_metric(list(labels), float(value))
            yield fam


class MetricsServer:
    """A /metrics endpoint on ``host:port`` until :meth:`close`."""

    def __init__(self, host: str, port: int, metrics: Iterable[Metric], read: Callable[[], Samples]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(metrics, read))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise OSError(f"cannot serve metrics on {host}:{port}: {exc}; pick another metrics_port") from None
        self.port = self._server.server_address[1]
        logger.info("metrics at http://%s:%d/metrics", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def serve(host: str, port: int, metrics: Iterable[Metric], read: Callable[[], Samples]) -> MetricsServer:
    return MetricsServer(host, port, metrics, read)
