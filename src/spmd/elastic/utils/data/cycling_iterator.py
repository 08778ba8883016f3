"""CyclingIterator (torch's elastic path): the iterators `generator_fn(epoch)` makes for epochs start_epoch up to
n - 1, one after another, as one iterator (an elastic job's loader, restarted at `start_epoch`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


class CyclingIterator(Iterator[T]):
    """Iterates `generator_fn(epoch)` for epoch = start_epoch, ..., n - 1 (at least start_epoch's; each epoch's
    iterator made when the previous one ends), then stops, as torch's does."""

    def __init__(self, n: int, generator_fn: Callable[[int], Iterator[T]], start_epoch: int = 0) -> None:
        self._last = n - 1
        self._epoch = start_epoch
        self._make = generator_fn
        self._current = generator_fn(start_epoch)

    def __iter__(self) -> CyclingIterator[T]:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                return next(self._current)
            except StopIteration:
                if self._epoch >= self._last:
                    raise
                self._epoch += 1
                self._current = self._make(self._epoch)
