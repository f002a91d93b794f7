"""An exact-match cache of results in front of the queue: least recently used first out, bounded in bytes.

Keys are ``(model, input key)``, where the input key is everything that decides a row: the complete
token ids (prompt, truncation and special tokens already applied) and the sequence's marks (where a
pair's second segment starts, where pooling starts). ``dimensions`` is not in it: rows are stored at
the model's full width and cut per request. One cache serves every model of the engine, so
``--cache-mb`` bounds them together. Event loop only (the batchers'); no locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import numpy as np

# What one entry costs beyond its row: the key's ids (a bytes object), the tuple and the dict slot.
_ENTRY_OVERHEAD = 160
_F32 = np.dtype(np.float32)


class ResultCache:
    """``(model, key) → row`` with a byte bound; ``capacity_bytes`` 0 caches nothing."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity = capacity_bytes
        self.bytes = 0
        self._rows: OrderedDict[tuple[str, Hashable], tuple[np.ndarray, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, model: str, key: Hashable) -> np.ndarray | None:
        found = self._rows.get((model, key))
        if found is None:
            return None
        self._rows.move_to_end((model, key))
        return found[0]

    def put(self, model: str, key: Hashable, row: np.ndarray, key_bytes: int) -> None:
        """Keep a copy of ``row`` (never a view that would pin its whole batch), evicting the least
        recently used rows to stay within the bound; a row bigger than the bound is not kept."""
        size = row.nbytes + key_bytes + _ENTRY_OVERHEAD
        where = (model, key)
        if size > self.capacity or where in self._rows:
            return
        # (astype copies, float32 or not: one call, no dtype comparison first, paid for every row kept)
        kept = row.astype(_F32)
        self._rows[where] = (kept, size)
        self.bytes += size
        while self.bytes > self.capacity:
            _, (_, evicted) = self._rows.popitem(last=False)
            self.bytes -= evicted
