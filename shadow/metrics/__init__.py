"""Prometheus metrics of the coordinator, the workers and the trainers."""

from shadow.metrics._exposition import MetricsServer, Samples, serve
from shadow.metrics.catalog import ALL, COORDINATOR, TRAINER, WORKER, Metric, exposed_names

__all__ = ["ALL", "COORDINATOR", "TRAINER", "WORKER", "Metric", "MetricsServer", "Samples", "exposed_names", "serve"]
