"""A memory of what texts read as, in two generations: what is no longer seen is forgotten, what still is stays.

The scanner (:mod:`vllm_capacity.sources.vllm_scan`) remembers in one each the lines it found in vLLM's body (what
each was), its selected lines read whole and the series part of its sample lines: the same lines come back every
read, and a few change.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Remembered(Generic[K, V]):
    """What a text read as, remembered in two generations: a text is looked for in the current one, then in the
    previous one (and moved back). When the owner turns it (the scanner does every few dozen parses), and when the
    current one holds ``bound()`` texts, the current generation becomes the previous one and the old previous one is
    dropped: what is no longer served (a model that went, an engine that restarted under new labels, a value that
    moved) is forgotten within two generations (5,000 models in turn held ~20 MiB of series until the cache was
    full)."""

    def __init__(self, bound: Callable[[], int]) -> None:
        self.current: dict[K, V] = {}  # read first, inline, on the hot path
        self.previous: dict[K, V] = {}
        self._bound = bound

    def recall(self, text: K) -> V | None:
        """The value of a text not in the current generation: from the previous one (moved back), or None."""
        value = self.previous.pop(text, None)
        if value is not None:
            self.remember(text, value)
        return value

    def remember(self, text: K, value: V) -> None:
        if len(self.current) >= self._bound():
            self.turn()
        self.current[text] = value

    def turn(self) -> None:
        self.current, self.previous = {}, self.current

    def __len__(self) -> int:
        return len(self.current) + len(self.previous)
