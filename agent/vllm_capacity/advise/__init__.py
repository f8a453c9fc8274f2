"""``vllm-capacity advise``: what to change, from a window of real traffic in Prometheus (the rules: levers.traffic)."""
