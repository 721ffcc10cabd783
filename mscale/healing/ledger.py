"""Bounded, time-ordered books for deduplication and rate limits: O(1) per entry, amortised.

`Ledger` maps a key (a condition's identity, an alert's fingerprint and start) to when it was
last marked, oldest first. It never grows past `cap` (the oldest entries are evicted first,
and counted), and entries older than `ttl_s` are dropped from the old end as new ones are
marked: expiry never scans the table, so the cost of a mark does not grow with history.
A lookup checks the entry's age itself (`fresh`), so an entry past `ttl_s` that pruning has
not reached yet is not taken for a live one.

`Budget` is a sliding one-minute window of units spent (actions, here): `take(n)` grants
what fits of n, in order, and books it; its books hold one entry per grant, so at most the
budget's size.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable


class Ledger:
    """key -> when last marked; at most `cap` entries, entries older than `ttl_s` expire."""

    def __init__(self, *, cap: int, ttl_s: float | None = None) -> None:
        if cap < 1:
            raise ValueError(f"cap: expected at least 1, got {cap}")
        self.cap = cap
        self.ttl_s = ttl_s
        self.evicted = 0  # entries dropped by the cap before they expired
        self._items: OrderedDict[Hashable, float] = OrderedDict()

    def mark(self, key: Hashable, now: float) -> None:
        """Record key at `now` (newest); expire and evict from the oldest end."""
        self._items[key] = now
        self._items.move_to_end(key)
        self.expire(now)
        while len(self._items) > self.cap:
            self._items.popitem(last=False)
            self.evicted += 1

    def expire(self, now: float) -> None:
        """Drop entries older than ttl_s from the oldest end (stops at the first live one)."""
        if self.ttl_s is None:
            return
        items = self._items
        while items:
            key, when = next(iter(items.items()))
            if now - when < self.ttl_s:
                return
            del items[key]

    def get(self, key: Hashable) -> float | None:
        return self._items.get(key)

    def fresh(self, key: Hashable, now: float, window_s: float | None = None) -> bool:
        """Marked within window_s (default ttl_s; None: marked at all) before now."""
        when = self._items.get(key)
        if when is None:
            return False
        window = self.ttl_s if window_s is None else window_s
        return window is None or now - when < window

    def pop(self, key: Hashable) -> float | None:
        return self._items.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)


class Budget:
    """At most `per_minute` units in any sliding 60 s window."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._grants: deque[tuple[float, int]] = deque()  # (when, units), oldest first
        self._spent = 0

    def left(self, now: float) -> int:
        grants = self._grants
        while grants and now - grants[0][0] >= self.WINDOW_S:
            self._spent -= grants.popleft()[1]
        return self.per_minute - self._spent

    def take(self, n: int, now: float) -> int:
        """Grant what fits of n units (0..n) and book it."""
        fit = max(0, min(n, self.left(now)))
        if fit:
            self._grants.append((now, fit))
            self._spent += fit
        return fit
