"""vLLM's ``/metrics`` read as the agent needs it, as prometheus-client would read it, in bounded time and memory.

One family of modules, in the order a body goes through them: :mod:`.stream` takes the body as it arrives, a
segment of whole lines at a time; :mod:`.select` finds the lines of the families the agent reads, within bounds;
:mod:`.scan` parses them (prometheus-client's parser is its oracle, and takes over at any line not in the canonical
form); :mod:`.parse` checks the body and reduces the families to :mod:`.records`, plain data. :mod:`.memory` is
what a reader remembers of lines from one body to the next, owned by the client that reads, keyed by whole lines.
``tests/test_vllm_scan.py`` and ``tests/test_fuzz.py`` hold the fast paths to their plain definitions and to the
library, byte for byte.
"""
