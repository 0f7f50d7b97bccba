"""A worker's cache of hot rows, with a staleness bound (as in HET, VLDB 2022).

With Zipf-skewed ids most of a batch's lookups hit a few hot rows, and without a
cache every step pulls them again. `RowCache` keeps, per table, up to `rows` rows the
worker pulled, each with the worker step it was pulled at; a lookup at step t uses a
kept row only if it was pulled at step t - S or later (S = `staleness`), and pulls the
others (then keeps them). So no row the worker computes with is more than S of its
steps older than the servers' copy was when pulled; gradients go to the servers as
before (the cache holds no updates of its own).

A kept row also misses at most S updates by other workers, as of this worker's last
push of it (`note_pushed`): each row carries its server's version (the updates applied
to it, `table.RowTable`) as pulled, and counts this worker's pushes of it since. A
push's reply gives the pushed rows' versions after it: a copy that misses more than S
updates of others (version now - version pulled - own pushes), or whose row was
replaced on its server (recreated, restored, back from disk: a version below version
pulled + own pushes), is dropped, and pulled again at its next use. A server that was
reset or restored (a new generation) has every row it owns dropped from every
table's cache (`drop_owned_by`; `client.RemoteSource` watches the generations) before
anything more is served. When full, the rows used least
recently make room, an eighth of the cache at a time; rows used in the current step
are never dropped (a batch with more new rows than that keeps what fits). Where
lookups hardly ever hit (uniform ids), it stands aside for a while (`_judge`).

The id -> slot map: for a table of a fixed size whose id space takes no more memory
as a direct array (4 bytes an id) than the hash map would at most (`HASH_BYTES` a kept
row), that array (a lookup is one gather); else the hash map, sized once for the
entries it holds between rebuilds. Either way its memory is bounded by `rows`, whatever
the table's size.

Sync mode never uses a cache: a sync step reads exactly the parameters of the step
before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .ids import owner_of
from .index import MAX_LOAD, DirectIndex, IdIndex
from .scatter import fill_rows, put_rows

NEVER = -(1 << 62)
HASH_BYTES = 96  # the hash map's bytes per kept row at most (12 a slot, up to 8 a row)
JUDGE_EVERY = 16  # lookups between checks of the hit rate
MIN_HIT_RATE = 0.05  # below it (uniform ids: nothing repeats) the cache stands aside
STAND_ASIDE = 256  # lookups, then it tries again
MAX_STAND_ASIDE = 16384  # (twice as long after each try that finds nothing, up to this)


@dataclass(frozen=True)
class Lookup:
    """A lookup between its two halves: the rows found, and where the pulled go."""

    ids: torch.Tensor
    step: int
    out: torch.Tensor  # rows of `ids`; those at `miss` still to fill
    miss: torch.Tensor  # positions in `ids` to pull
    found: torch.Tensor  # the slot of each of `ids` where held (fresh or not), else -1
    keep: bool = True  # False: the cache stands aside (see `RowCache`)

    @property
    def missing(self) -> torch.Tensor:
        return self.ids[self.miss]

    @property
    def slots(self) -> torch.Tensor:
        """The slots of the ids to pull where held (stale), else -1."""
        return self.found.index_select(0, self.miss)


class RowCache:
    def __init__(self, dim: int, rows: int, staleness: int, num_ids: int | None = None
                 ) -> None:
        """`num_ids`: the table's fixed size (None: any int64 id), for the id map."""
        if rows < 1 or staleness < 1:
            raise ValueError(f"a row cache needs rows >= 1 and staleness >= 1, got {rows} "
                             f"and {staleness}")
        self.capacity = rows
        self.staleness = staleness
        # id -> slot (see the module doc); a slot given to another id is checked by
        # `_held`. A hash map keeps the entries of dropped ids until `_reindex`: sized
        # for that many, it never grows (a growth rebuilds it whole).
        self.index: DirectIndex | IdIndex = (
            DirectIndex(num_ids) if num_ids is not None and 4 * num_ids <= rows * HASH_BYTES
            else self._new_index())
        self.rows = torch.empty((rows, dim))  # pages mapped only as slots fill
        self.owner = torch.full((rows,), -1, dtype=torch.int64)  # id in each slot
        self.pulled = torch.full((rows,), NEVER, dtype=torch.int64)  # step pulled
        self.used = torch.full((rows,), NEVER, dtype=torch.int64)  # step last used
        # The server's version of each row as pulled (-1: not known), and this worker's
        # pushes of it since (see `note_pushed`).
        self.version = torch.full((rows,), -1, dtype=torch.int32)
        self.own = torch.zeros(rows, dtype=torch.int32)
        # The ids of the last lookup and their slots (`note_pushed` of the same ids,
        # the usual case, needs no second search of the id map).
        self.recent: tuple[torch.Tensor, torch.Tensor] | None = None
        self.free = torch.arange(rows - 1, -1, -1)  # slots to fill, taken from the end
        self.hits = 0
        self.misses = 0
        self.window = [0, 0]  # hits, lookups since the last check of the hit rate
        self.judged = 0  # lookups since that check
        self.aside = 0  # lookups left standing aside
        self.aside_for = STAND_ASIDE  # how long the next time aside lasts

    def lookup(self, ids: torch.Tensor, step: int,
               pull: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Rows of `ids` (unique int64) at worker step `step`: kept rows pulled at step
        - S or later, the others from `pull` (then kept)."""
        plan = self.plan(ids, step)
        return self.finish(plan, pull(plan.missing))

    def plan(self, ids: torch.Tensor, step: int) -> Lookup:
        """The first half of `lookup`: the kept rows found, and the ids to pull."""
        if self.aside:  # a hit rate too low to pay for the lookups: pull everything
            self.aside -= 1
            self.misses += int(ids.numel())
            everything = torch.arange(ids.numel())
            return Lookup(ids, step, torch.empty(0), everything,
                          torch.full((ids.numel(),), -1), keep=False)
        found = self._held(ids)
        fresh = self.pulled.index_select(0, found.clamp(min=0)) >= step - self.staleness
        fresh &= found >= 0
        hit = torch.nonzero(fresh).reshape(-1)
        miss = torch.nonzero(~fresh).reshape(-1)
        out = torch.empty((ids.numel(), self.rows.shape[1]), dtype=torch.float32)
        if hit.numel():
            at = found.index_select(0, hit)
            put_rows(out, hit, self.rows.index_select(0, at))
            fill_rows(self.used, at, step)
        self.hits += int(hit.numel())
        self.misses += int(miss.numel())
        self._judge(int(hit.numel()), int(ids.numel()))
        return Lookup(ids, step, out, miss, found)

    def _held(self, ids: torch.Tensor, slots: torch.Tensor | None = None) -> torch.Tensor:
        """The slot holding each of `ids`, else -1 (`slots`: where the id map said they
        were, when known)."""
        if slots is None:
            slots = self._find(ids)
        held = self.owner.index_select(0, slots.clamp(min=0)) == ids
        return torch.where(held & (slots >= 0), slots, -1)

    def _find(self, ids: torch.Tensor) -> torch.Tensor:
        """The id map's slot of each of `ids`, else -1 (an id outside a direct map's
        range is not held: it is pulled, and its server refuses it)."""
        inside = self._mappable(ids)
        if inside is None or bool(inside.all()):
            return torch.from_numpy(self.index.get(ids.numpy()))
        slots = torch.full(ids.shape, -1, dtype=torch.int64)
        slots[inside] = torch.from_numpy(self.index.get(ids[inside].numpy()))
        return slots

    def _mappable(self, ids: torch.Tensor) -> torch.Tensor | None:
        """Which of `ids` a direct map can hold (its table's range); None for the hash
        map, which holds any id."""
        if not isinstance(self.index, DirectIndex):
            return None
        return (ids >= 0) & (ids < self.index.num_ids)

    def _judge(self, hits: int, lookups: int) -> None:
        """Every JUDGE_EVERY lookups: below MIN_HIT_RATE (ids that do not repeat within
        S steps, such as uniform ones), stand aside for STAND_ASIDE lookups, twice as
        long each time in a row: no row is looked up or kept, so the cache costs
        nothing where it cannot help."""
        self.window[0] += hits
        self.window[1] += lookups
        self.judged += 1
        if self.judged < JUDGE_EVERY:
            return
        if self.window[0] < MIN_HIT_RATE * self.window[1]:
            self.aside = self.aside_for
            # Each time in a row it finds nothing worth it, it stands aside twice as
            # long: a table that never repeats stops paying for the checks.
            self.aside_for = min(2 * self.aside_for, MAX_STAND_ASIDE)
            self.pulled.fill_(NEVER)  # nothing kept is served after the time aside
        else:
            self.aside_for = STAND_ASIDE
        self.window, self.judged = [0, 0], 0

    @property
    def active(self) -> bool:
        """Not standing aside: lookups go through the cache (and versions are wanted)."""
        return not self.aside

    def finish(self, plan: Lookup, pulled: torch.Tensor,
               versions: torch.Tensor | None = None) -> torch.Tensor:
        """The second half: the pulled rows (of `plan.missing`, in order) in place, and
        kept with their `versions` (None: not known; those rows are never dropped for
        updates missed). Nothing may be dropped between `plan` and `finish`."""
        if not plan.keep:
            return pulled
        found = plan.found
        if plan.miss.numel():
            put_rows(plan.out, plan.miss, pulled)
            if self.aside:  # it stood aside at this lookup: nothing more is kept
                return plan.out
            if versions is None:
                versions = torch.full((plan.miss.numel(),), -1, dtype=torch.int32)
            kept = self._keep(plan.missing, pulled, versions, plan.slots, plan.step)
            found = found.index_copy(0, plan.miss, kept)
        self.recent = (plan.ids, found)
        return plan.out

    def note_pushed(self, ids: torch.Tensor, versions: torch.Tensor) -> int:
        """This worker pushed gradients of `ids`, whose rows stand at `versions` on
        their server after the push: count the push for each kept row, and expire those
        that now miss more than S updates of other workers, or whose row was replaced
        on the server (see the module doc). Returns the rows expired."""
        if not ids.numel() or self.aside:  # aside: nothing kept will be served
            return 0
        looked, slots = self.recent or (None, None)
        if looked is None or not (
                looked is ids or looked.shape == ids.shape and torch.equal(looked, ids)):
            slots = None  # not the ids of the last lookup: ask the id map
        slots = self._held(ids, slots).numpy()  # (numpy: a fifth of torch's indexing cost)
        held = slots >= 0
        at = slots[held]
        own = self.own.numpy()
        own[at] += 1  # (an id named twice: one update on the server, one count)
        pulled = self.version.numpy()[at].astype(np.int64)
        missed = versions.numpy()[held].astype(np.int64) - pulled - own[at]
        stale = np.unique(at[(pulled >= 0) & ((missed > self.staleness) | (missed < 0))])
        self._expire(torch.from_numpy(stale))
        return len(stale)

    def drop_owned_by(self, ps: int, num_ps: int) -> int:
        """Expire every kept row that server `ps` (of `num_ps`) owns (`ids.owner_of`):
        its rows were replaced (a new generation). Returns the rows expired."""
        held = torch.nonzero(self.owner >= 0).reshape(-1)
        if not held.numel():
            return 0
        gone = held[owner_of(self.owner[held], num_ps) == ps]
        self._expire(gone)
        return int(gone.numel())

    def _expire(self, slots: torch.Tensor) -> None:
        """Never serve these slots' rows again: the next lookup of their ids pulls them
        and refreshes them in place (the slots stay theirs, the id map unchanged)."""
        fill_rows(self.pulled, slots, NEVER)

    def _drop(self, slots: torch.Tensor) -> None:
        """Free the slots (distinct, held): their ids are pulled at their next use."""
        if slots.numel():
            self.owner[slots] = -1
            self.free = torch.cat([slots, self.free])

    def _keep(self, ids: torch.Tensor, rows: torch.Tensor, versions: torch.Tensor,
              slots: torch.Tensor, step: int) -> torch.Tensor:
        """Store pulled rows: refreshed in their slots where held, else in free slots.
        Returns the slot of each (-1: not kept, the cache being full of this step's)."""
        known = torch.nonzero(slots >= 0).reshape(-1)
        absent = slots < 0
        inside = self._mappable(ids)
        if inside is not None:  # a direct map holds only the table's ids
            absent &= inside
        new = torch.nonzero(absent).reshape(-1)
        if new.numel():
            where = self._take(int(new.numel()), step)
            new = new[:where.numel()]
            slots = slots.index_copy(0, new, where)
            put_rows(self.owner, where, ids.index_select(0, new))
            if (isinstance(self.index, IdIndex)
                    and self.index.size + new.numel() > self._most_entries()):
                self._reindex()  # from `owner`: the new ids are in it
            else:
                self.index.put(ids[new].numpy(), where.numpy())
        kept = torch.cat([known, new])
        where = slots.index_select(0, kept)
        put_rows(self.rows, where, rows.index_select(0, kept))
        put_rows(self.version, where, versions.index_select(0, kept))
        fill_rows(self.own, where, 0)
        fill_rows(self.pulled, where, step)
        fill_rows(self.used, where, step)
        return slots

    def _take(self, count: int, step: int) -> torch.Tensor:
        """Up to `count` free slots; when short, the rows used least recently (before
        `step`) are dropped first, at least an eighth of the cache at once."""
        if self.free.numel() < count:
            # (numpy: its nonzero and its vectorised partial sort take a fifth of
            # torch.nonzero's and torch.topk's time over a cache of 262,144 rows)
            used = self.used.numpy()
            old = np.flatnonzero((used < step) & (self.owner.numpy() >= 0))
            drop = min(len(old), max(count - self.free.numel(), self.capacity // 8))
            if drop:
                if drop < len(old):
                    old = old[np.argpartition(used[old], drop - 1)[:drop]]
                self._drop(torch.from_numpy(old))
        take = min(count, self.free.numel())
        taken = self.free[self.free.numel() - take:]
        self.free = self.free[:self.free.numel() - take]
        return taken

    def _most_entries(self) -> int:
        """Entries of the id map (held ids and dropped ones) before `_reindex`."""
        return 2 * self.capacity + 1024

    def _new_index(self) -> IdIndex:
        return IdIndex(int(self._most_entries() / MAX_LOAD) + 1)

    def _reindex(self) -> None:
        """Drop the map's entries of ids no longer held."""
        live = torch.nonzero(self.owner >= 0).reshape(-1)
        self.index = self._new_index()
        self.index.add(self.owner[live].numpy(), live.numpy())
