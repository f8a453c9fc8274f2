"""Limits and levers: from readings of a server under load to the limit that binds, the knee of a concurrency sweep,
and the flags that would move it, with numbers. Plain functions over plain data, no I/O: ``sweep`` runs them over
its steps, ``advise`` over a window of traffic.

:mod:`.limits` names the binding limit of a stretch of readings (vLLM's own evidence first, as the live agent names
it: :func:`vllm_capacity.derive.concurrency_limit`); :mod:`.knee` finds a sweep's knee; :mod:`.advice` lists the
levers that could move the limit found, and leaves out those that cannot.
"""
