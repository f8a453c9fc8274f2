"""The live pipeline's parts: each reader or learner owns its state; :mod:`vllm_capacity.live.agent` gathers them."""
