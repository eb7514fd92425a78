"""Host-side ownership of fixed-size units (KV pages, window slots): alloc all-or-nothing, free once."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["IntegrityError", "OutOfCapacity", "UnitAllocator"]


class OutOfCapacity(RuntimeError):
    """Not enough free units; nothing was allocated."""


class IntegrityError(RuntimeError):
    """A unit freed twice, freed by a non-owner, or the free list and owners disagree."""


class UnitAllocator:
    """Every unit is either free or owned by exactly one owner id (a request).

    Lives on the host: allocation decisions never touch the device, so they never sync. Ownership is
    kept per owner as an insertion-ordered dict: a free or a hand-over costs the units it moves, not
    what their owner holds (the prefix cache's owner holds most of the pool, and gives back a few
    pages at a time).
    """

    def __init__(self, capacity: int, what: str = "page") -> None:
        if capacity <= 0:
            raise ValueError(f"{what} capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.what = what
        self._held: dict[int, dict[int, None]] = {}  # owner -> its units, in the order it got them
        self._free = list(range(capacity - 1, -1, -1))  # the end is handed out first: low ids first

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
        if n <= 0:
            return []
        units = self._free[: -n - 1 : -1]
        del self._free[-n:]
        self._held.setdefault(owner, {}).update(dict.fromkeys(units))
        return units

    def free(self, owner: int, units: Sequence[int]) -> None:
        self.free_many([(owner, units)])

    def free_many(self, frees: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Free each (owner, units) pair's units, all or nothing: checked whole before anything changes."""
        wanted: dict[int, list[int]] = {}
        for owner, units in frees:
            if units:
                wanted.setdefault(owner, []).extend(units)
        for owner, units in wanted.items():
            held = self._held.get(owner, {})
            if len(set(units)) != len(units):
                u = next(u for u in units if units.count(u) > 1)
                raise IntegrityError(f"{self.what} {u} freed twice in one call by {owner}")
            missing = [u for u in units if u not in held]
            if missing:
                u = min(missing)
                raise IntegrityError(f"{self.what} {u} freed by {owner} but held by {self._holder(u)}")
        for owner, units in wanted.items():
            held = self._held[owner]
            if len(units) == len(held):
                del self._held[owner]
            else:
                for u in units:
                    del held[u]
            self._free.extend(units)

    def _holder(self, unit: int) -> str:
        if not 0 <= unit < self.capacity:
            return "out of range"
        return next((str(o) for o, us in self._held.items() if unit in us), "no one (free)")

    def transfer(self, owner: int, to: int, units: Sequence[int]) -> None:
        """Hand `units` that `owner` holds to `to` (the prefix cache keeps a finished prompt's pages)."""
        held = self._held.get(owner, {})
        missing = [u for u in units if u not in held]
        if missing:
            u = min(missing)
            raise IntegrityError(f"{self.what} {u} handed on by {owner} but held by {self._holder(u)}")
        if len(set(units)) != len(units):
            raise IntegrityError(f"a {self.what} handed on twice in one call by {owner}")
        for u in units:
            del held[u]
        if not held:
            self._held.pop(owner, None)
        self._held.setdefault(to, {}).update(dict.fromkeys(units))

    def free_units(self) -> list[int]:
        return list(self._free)

    def owned_by(self, owner: int) -> list[int]:
        return sorted(self._held.get(owner, []))

    def check_integrity(self) -> None:
        """Every unit free or owned exactly once (pool conservation); call when idle or in tests."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError(f"a {self.what} is on the free list twice")
        seen: set[int] = set()
        for owner, units in self._held.items():
            for u in units:
                if u in free or u in seen or not 0 <= u < self.capacity:
                    raise IntegrityError(f"{self.what} {u}: owned by {owner} and free or owned again")
                seen.add(u)
        lost = set(range(self.capacity)) - free - seen
        if lost or len(free) + len(seen) != self.capacity:
            u = min(lost) if lost else -1
            raise IntegrityError(f"{self.what} {u}: neither owned nor on the free list")
