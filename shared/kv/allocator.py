"""Host-side ownership of fixed-size units (KV pages, window slots): alloc all-or-nothing, free once."""

from __future__ import annotations

__all__ = ["IntegrityError", "OutOfCapacity", "UnitAllocator"]

FREE = -1


class OutOfCapacity(RuntimeError):
    """Not enough free units; nothing was allocated."""


class IntegrityError(RuntimeError):
    """A unit freed twice, freed by a non-owner, or the free list and owners disagree."""


class UnitAllocator:
    """Every unit is either free or owned by exactly one owner id (a request).

    Lives on the host: allocation decisions never touch the device, so they never sync.
    """

    def __init__(self, capacity: int, what: str = "page") -> None:
        if capacity <= 0:
            raise ValueError(f"{what} capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.what = what
        self._owner = [FREE] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def alloc(self, owner: int, n: int) -> list[int]:
        if owner < 0:
            raise ValueError(f"owner ids are non-negative, got {owner}")
        if n > len(self._free):
            raise OutOfCapacity(f"need {n} {self.what}s, {len(self._free)} free of {self.capacity}")
        units = [self._free.pop() for _ in range(n)]
        for u in units:
            self._owner[u] = owner
        return units

    def free(self, owner: int, units: list[int]) -> None:
        # Checked whole before anything changes. A batch's requests finishing together free
        # thousands of pages in one step: comprehensions, not a loop of appends.
        owners, cap = self._owner, self.capacity
        bad = [u for u in units if not 0 <= u < cap or owners[u] != owner]
        if bad:
            u = bad[0]
            holder = owners[u] if 0 <= u < cap else "out of range"
            raise IntegrityError(f"{self.what} {u} freed by {owner} but held by {holder}")
        if len(set(units)) != len(units):
            raise IntegrityError(f"{self.what} freed twice in one call by {owner}: {sorted(units)}")
        for u in units:
            owners[u] = FREE
        self._free.extend(units)

    def owned_by(self, owner: int) -> list[int]:
        return [u for u, o in enumerate(self._owner) if o == owner]

    def check_integrity(self) -> None:
        """Every unit free or owned exactly once (pool conservation); call when idle or in tests."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError(f"a {self.what} is on the free list twice")
        for u, o in enumerate(self._owner):
            if (o == FREE) != (u in free):
                where = "on" if u in free else "not on"
                raise IntegrityError(f"{self.what} {u}: owner {o} but {where} the free list")
