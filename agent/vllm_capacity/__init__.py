"""vllm-capacity: a sidecar agent and Prometheus exporter for vLLM serving capacity."""

__version__ = "0.1.0"
