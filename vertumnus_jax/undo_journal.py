"""Undo journal of the prefix cache's all-or-nothing transactions.

While a transaction is open every mutation of the cache (tree, refcounts, LRU ages, block
states) records a callable that reverses it; when the transaction's body raises, the callables
run newest first and the cache restores what it snapshots itself (events, LRU tick, heaps).
Nested transactions join the outermost one. Used by `vertumnus_jax.prefix_cache.PrefixCache`
and its `vertumnus_jax.block_allocator.BlockAllocator`.

Source: the undo log of a write-ahead transaction (rollback by inverse operations, newest first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


class UndoJournal:
    """The undo operations of the open transaction, if any.

    `log(op)` records `op` (a no-argument callable that reverses one change) only while a
    transaction is open; outside one it does nothing. Undo operations run with the journal
    closed, so they log nothing themselves.
    """

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] | None = None

    @property
    def is_open(self) -> bool:
        """Whether a transaction is open."""
        return self._undo is not None

    def log(self, op: Callable[[], None]) -> None:
        """Records `op`, the inverse of a change just made, when a transaction is open."""
        if self._undo is not None:
            self._undo.append(op)

    @contextlib.contextmanager
    def transaction(self, restore: Callable[[], None]) -> Iterator[None]:
        """All-or-nothing block: when the body raises, every logged operation is undone (newest
        first), then `restore()` runs, then the exception is re-raised.

        A transaction opened inside an open one joins it: its body's changes are undone only
        when the outermost body raises, and its own `restore` is not called.
        """
        if self._undo is not None:
            yield
            return
        self._undo = []
        try:
            yield
        except BaseException:
            undo, self._undo = self._undo, None
            for op in reversed(undo):
                op()
            restore()
            raise
        finally:
            self._undo = None
