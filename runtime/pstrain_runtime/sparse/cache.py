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
anything more is served. Where lookups hardly ever hit (uniform ids), it stands aside
for a while (`_judge`).

Where a row goes: each id has one place (direct mapped, as a CPU's cache lines): for a
table of a fixed size that fits, its id (every row of the table can be kept at once);
else a hash of the id, so that ids sharing a place take turns, the one pulled last
staying. A lookup is a few gathers and compares over the batch's ids, with no id map
to search or maintain, no free list and no eviction pass: memory is `rows` x
(dim x 4 + 24) bytes a table, whatever the table's size.

Sync mode never uses a cache: a sync step reads exactly the parameters of the step
before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .ids import owner_of
from .scatter import put_rows

NEVER = -(1 << 62)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing's multiplier (2^64 / phi)
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
    places: np.ndarray  # the place of each of `ids` in the cache (-1: none)
    keep: bool = True  # False: the cache stands aside (see `RowCache`)

    @property
    def missing(self) -> torch.Tensor:
        return self.ids[self.miss]


class RowCache:
    def __init__(self, dim: int, rows: int, staleness: int, num_ids: int | None = None
                 ) -> None:
        """`num_ids`: the table's fixed size (None: any int64 id); a table of at most
        `rows` rows gets a place per id (see the module doc)."""
        if rows < 1 or staleness < 1:
            raise ValueError(f"a row cache needs rows >= 1 and staleness >= 1, got {rows} "
                             f"and {staleness}")
        self.direct = num_ids is not None and num_ids <= rows
        self.capacity = num_ids if self.direct else rows  # type: ignore[assignment]
        self.staleness = staleness
        self.rows = torch.empty((self.capacity, dim))  # pages mapped only as places fill
        self.owner = np.full(self.capacity, -1, dtype=np.int64)  # id in each place
        self.pulled = np.full(self.capacity, NEVER, dtype=np.int64)  # step pulled
        # The server's version of each row as pulled (-1: not known), and this worker's
        # pushes of it since (see `note_pushed`).
        self.version = np.full(self.capacity, -1, dtype=np.int32)
        self.own = np.zeros(self.capacity, dtype=np.int32)
        # The ids of the last lookup and their places (`note_pushed` of the same ids,
        # the usual case, computes no place again).
        self.recent: tuple[torch.Tensor, np.ndarray] | None = None
        self.hits = 0
        self.misses = 0
        self.window = [0, 0]  # hits, lookups since the last check of the hit rate
        self.judged = 0  # lookups since that check
        self.aside = 0  # lookups left standing aside
        self.aside_for = STAND_ASIDE  # how long the next time aside lasts

    def places_of(self, ids: torch.Tensor) -> np.ndarray:
        """The place of each of `ids` (int64) in the cache, -1 for an id a direct cache
        has no place for (outside its table: pulled, and refused by its server)."""
        keys = ids.numpy()
        if self.direct:
            return np.where((keys >= 0) & (keys < self.capacity), keys, -1)
        with np.errstate(over="ignore"):  # Fibonacci hashing: the product's top 32 bits,
            mixed = (keys.view(np.uint64) * _GOLDEN) >> np.uint64(32)
        mixed *= np.uint64(self.capacity)  # then their share of the places (< 2^63)
        return (mixed >> np.uint64(32)).view(np.int64)

    def _held(self, ids: torch.Tensor, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each id's place to read (`places`, with -1 read at 0) and whether the cache
        holds that id there (never where an id has no place)."""
        at = places.clip(min=0) if self.direct else places  # (hashed: never -1)
        held = self.owner[at] == ids.numpy()
        if self.direct:
            held &= places >= 0
        return at, held

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
            return Lookup(ids, step, torch.empty(0), torch.arange(ids.numel()),
                          np.full(ids.numel(), -1), keep=False)
        places = self.places_of(ids)
        at, fresh = self._held(ids, places)
        fresh &= self.pulled[at] >= step - self.staleness
        hit = np.flatnonzero(fresh)
        miss = torch.from_numpy(np.flatnonzero(~fresh))
        out = torch.empty((ids.numel(), self.rows.shape[1]), dtype=torch.float32)
        if 2 * len(hit) > ids.numel():
            # Most rows are kept: one gather of every id's place, the rows of the
            # others (misses) overwritten by `finish`; a copy of each row once,
            # against a gather and a scatter of the hits.
            torch.index_select(self.rows, 0, torch.from_numpy(at), out=out)
        elif len(hit):
            put_rows(out, torch.from_numpy(hit),
                     self.rows.index_select(0, torch.from_numpy(places[hit])))
        self.hits += len(hit)
        self.misses += int(miss.numel())
        self._judge(len(hit), int(ids.numel()))
        return Lookup(ids, step, out, miss, places)

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
            self.pulled.fill(NEVER)  # nothing kept is served after the time aside
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
        updates missed), each in its place (of ids sharing a place, one)."""
        if not plan.keep:
            return pulled
        if plan.miss.numel():
            put_rows(plan.out, plan.miss, pulled)
            if self.aside:  # it stood aside at this lookup: nothing more is kept
                return plan.out
            self._keep(plan.missing.numpy(), pulled, versions,
                       plan.places[plan.miss.numpy()], plan.step)
        self.recent = (plan.ids, plan.places)
        return plan.out

    def _keep(self, ids: np.ndarray, rows: torch.Tensor, versions: torch.Tensor | None,
              places: np.ndarray, step: int) -> None:
        """Store pulled rows in their places. Ids that share a place each write their
        id there, and the one write that stays (read back) keeps its row."""
        some = places >= 0
        ids, places = ids[some], places[some]
        self.owner[places] = ids
        won = np.flatnonzero(self.owner[places] == ids)
        at = places[won]
        every = len(won) == len(some)  # (the usual case: no two ids in one place)
        put_rows(self.rows, torch.from_numpy(at),
                 rows if every else rows.index_select(0, torch.from_numpy(
                     np.flatnonzero(some)[won])))
        if versions is None:
            self.version[at] = -1
        else:
            self.version[at] = versions.numpy()[some][won]
        self.own[at] = 0
        self.pulled[at] = step

    def note_pushed(self, ids: torch.Tensor, versions: torch.Tensor) -> int:
        """This worker pushed gradients of `ids`, whose rows stand at `versions` on
        their server after the push: count the push for each kept row, and expire those
        that now miss more than S updates of other workers, or whose row was replaced
        on the server (see the module doc). Returns the rows expired."""
        if not ids.numel() or self.aside:  # aside: nothing kept will be served
            return 0
        looked, places = self.recent or (None, None)
        if looked is None or not (
                looked is ids or looked.shape == ids.shape and torch.equal(looked, ids)):
            places = self.places_of(ids)
        at, held = self._held(ids, places)  # type: ignore[arg-type]
        at = at[held]  # (distinct: a place holds one id)
        own = self.own[at] + 1
        self.own[at] = own
        pulled = self.version[at]
        # Updates missed, in int32 (versions wrap at 2^31: the difference does not):
        # above S, or below 0 (the row was replaced), is one unsigned compare.
        missed = versions.numpy()[held] - pulled - own
        stale = at[(missed.view(np.uint32) > self.staleness) & (pulled >= 0)]
        self.pulled[stale] = NEVER
        return len(stale)

    def drop_owned_by(self, ps: int, num_ps: int) -> int:
        """Expire every kept row that server `ps` (of `num_ps`) owns (`ids.owner_of`):
        its rows were replaced (a new generation). Returns the rows expired."""
        held = np.flatnonzero(self.owner >= 0)
        if not len(held):
            return 0
        gone = held[owner_of(torch.from_numpy(self.owner[held]), num_ps).numpy() == ps]
        self.pulled[gone] = NEVER
        return len(gone)
