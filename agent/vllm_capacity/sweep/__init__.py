"""``vllm-capacity sweep``'s engine: closed-loop load at each concurrency (:mod:`.load`), vLLM's own /metrics read
during each step with the agent's readers and derivations (:mod:`.sample`), and the steps run and summed up
(:mod:`.run`); the limit, the knee and the levers come from :mod:`vllm_capacity.levers`."""
