"""A memory of what texts read as, in two generations (:class:`Remembered`): what is no longer seen is forgotten, what
still is stays; and :class:`ReaderMemory`, the memories of one reader of vLLM's ``/metrics``.

The reader remembers, in one each, the lines it found in vLLM's body (what each was), its selected lines read whole
and the series part of its sample lines: the same lines come back every read, and a few change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


#: Most characters of texts one generation of a memory holds: what each text read as takes a few times its size, so a
#: memory stays within a few MiB whatever vLLM sends. 64 engines' series (about 540 KiB) fit; a body whose lines change
#: on every read (cache_config_info's labels, 512 engines: 280 MiB held by count alone) turns it instead.
GENERATION_CHARS = 1 << 20


class Remembered(Generic[K, V]):
    """What a text read as, remembered in two generations: a text is looked for in the current one, then in the
    previous one (and moved back). When the owner turns it (the scanner does every few dozen parses), and when the
    current one holds ``bound()`` texts or :data:`GENERATION_CHARS` characters of them, the current generation
    becomes the previous one and the old previous one is dropped: what is no longer served (a model that went, an
    engine that restarted under new labels, a value that moved) is forgotten within two generations (5,000 models in
    turn held ~20 MiB of series until the cache was full)."""

    def __init__(self, bound: Callable[[], int]) -> None:
        self.current: dict[K, V] = {}  # read first, inline, on the hot path
        self.previous: dict[K, V] = {}
        self._bound = bound
        self.chars = 0  # of the current generation's texts (keys that are not text count one each)

    def recall(self, text: K) -> V | None:
        """The value of a text not in the current generation: from the previous one (moved back), or None."""
        value = self.previous.pop(text, None)
        if value is not None:
            self.remember(text, value)
        return value

    def remember(self, text: K, value: V) -> None:
        size = len(text) if isinstance(text, (str, bytes)) else 1
        if len(self.current) >= self._bound() or self.chars + size > GENERATION_CHARS:
            self.turn()
        self.current[text] = value
        self.chars += size

    def turn(self) -> None:
        self.current, self.previous, self.chars = {}, self.current, 0

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)


class ReaderMemory:
    """What one reader of vLLM's ``/metrics`` remembers from one body to the next, owned by the client that reads
    (:class:`~vllm_capacity.sources.vllm.VllmClient` holds one), never by a module: what each line found was (per set
    of names looked for), each selected line read whole, and each sample's series part. Every entry is keyed by the
    whole text it was read from: a line that changed is a new key, so nothing read from one text is ever served for
    another. Each memory is bounded and turns in generations. A function given none reads with a fresh one, and reads
    exactly what a warm one reads (``tests/test_vllm_scan.py``)."""

    def __init__(self) -> None:
        self._memories: dict[Hashable, Remembered[Any, Any]] = {}
        self._uses: Counter[Hashable] = Counter()

    def of(self, key: Hashable, bound: Callable[[], int]) -> Remembered[Any, Any]:
        """The memory named ``key`` (made on first use, holding ``bound()`` texts a generation)."""
        memory = self._memories.get(key)
        if memory is None:
            memory = self._memories[key] = Remembered(bound)
        return memory

    def held(self, key: Hashable) -> Remembered[Any, Any]:
        """The memory named ``key`` as it is (empty if never used), to look at, not to fill."""
        return self._memories.get(key) or Remembered(lambda: 0)

    def use(self, key: Hashable, every: int) -> None:
        """One more read with ``key``'s memory: at every ``every``-th it turns, so what is no longer seen goes."""
        self._uses[key] += 1
        if self._uses[key] % every == 0 and key in self._memories:
            self._memories[key].turn()
