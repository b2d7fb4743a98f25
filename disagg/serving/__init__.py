"""What serves clients: the OpenAI API shapes, routing over decode nodes, Prometheus
metrics, admission bounds (per-client fairness) and CURVE security."""
