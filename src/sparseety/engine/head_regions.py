"""``HeadRegions``: one layer's KV heads each holding its own number of slots (kvzip's per-head counts).

KVzip (as kvpress's ``KVzipPress`` chooses) keeps a different number of slots in every KV head. A
rectangular ``[b, kv_heads, n, d]`` buffer would have to hold the busiest head's count in all of
them; here the heads share one row ``[1, 1, capacity, d]`` in which head ``i`` owns a region
``offsets[i] .. offsets[i] + capacities[i]`` whose first ``counts[i]`` slots are live, so memory is
the kept slots plus a little room to append. Each head's live slots are contiguous, so attention
runs per KV group over a plain view (no mask, no wasted products). Dead slots (a region's free room)
have position -1 and take no part in anything. The bookkeeping (offsets, counts) lives in Python
ints: a step reads no tensor to know where to write.
"""

from __future__ import annotations

import bisect

import torch

from sparseety.policies.base import select_evict_by_head

#: The most free slots a region is given when it is (re)built.
REGION_ROOM = 256


def _room(count: int) -> int:
    """Free slots a region of ``count`` live slots is given when it is (re)built."""
    return min(REGION_ROOM, max(8, count // 8))


class HeadRegions:
    """The slots of one sequence's layer, KV head by KV head (see the module docstring).

    Parameters
    ----------
    keys, values : ``[kv_heads, n, d]`` the layer's live slots; positions ``[kv_heads, n]``;
        state ``[kv_heads, n]`` or None (the policy's accumulator).
    keep : per KV head, ``[k_i]`` the slot indices it keeps (any order).
    budgets : per KV head, the slots it keeps from then on.
    norms : ``[kv_heads, n, g]`` the slots' value norms (importance scoring), or None; kept in :attr:`norm`
        ``[1, 1, capacity, g]``, moving with their slots.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 state: torch.Tensor | None, keep: list[torch.Tensor], budgets: list[int],
                 norms: torch.Tensor | None = None) -> None:
        slots = [s.sort().values for s in keep]
        self.budgets = list(budgets)
        self.counts = [int(s.numel()) for s in slots]
        self._build([keys[i, s] for i, s in enumerate(slots)], [values[i, s] for i, s in enumerate(slots)],
                    [positions[i, s] for i, s in enumerate(slots)],
                    None if state is None else [state[i, s] for i, s in enumerate(slots)], [0] * len(slots),
                    None if norms is None else [norms[i, s] for i, s in enumerate(slots)])

    def _build(self, keys: list[torch.Tensor], values: list[torch.Tensor], positions: list[torch.Tensor],
               state: list[torch.Tensor] | None, extra: list[int], norms: list[torch.Tensor] | None = None) -> None:
        """New buffers holding each head's live ``keys[i]`` ... (``[count_i, ...]``), with room for ``extra[i]`` more."""
        self.capacities = [c + x + _room(c + x) for c, x in zip(self.counts, extra)]
        self.offsets = [sum(self.capacities[:i]) for i in range(len(self.capacities))]
        total, d = sum(self.capacities), keys[0].shape[-1]
        ref = keys[0]
        self.k = ref.new_zeros(1, 1, total, d)
        self.v = values[0].new_zeros(1, 1, total, d)
        self.pos = torch.full((1, 1, total), -1, dtype=torch.long, device=ref.device)
        self.state = None if state is None else state[0].new_zeros(1, 1, total)
        self.norm = None if norms is None else norms[0].new_zeros(1, 1, total, norms[0].shape[-1])
        self.owner = torch.cat([torch.full((c,), i, dtype=torch.long, device=ref.device)
                                for i, c in enumerate(self.capacities)]).view(1, 1, total)
        # flat views ``[capacity, ...]`` of the buffers this object owns (``state`` is the policy's: it is replaced)
        self._rows = [b[0, 0] for b in (self.k, self.v, self.pos, self.norm) if b is not None]
        for i, (start, n) in enumerate(zip(self.offsets, self.counts)):
            self.k[0, 0, start : start + n], self.v[0, 0, start : start + n] = keys[i], values[i]
            self.pos[0, 0, start : start + n] = positions[i]
            if self.state is not None and state is not None:
                self.state[0, 0, start : start + n] = state[i]
            if self.norm is not None and norms is not None:
                self.norm[0, 0, start : start + n] = norms[i]
        self.budget_tensor = torch.tensor(self.budgets, dtype=torch.long, device=ref.device)

    # -- views ---------------------------------------------------------------------------------------
    @property
    def heads(self) -> int:
        return len(self.counts)

    def live(self, head: int) -> slice:
        """Head ``head``'s live slots in the row."""
        return slice(self.offsets[head], self.offsets[head] + self.counts[head])

    def head_keys(self, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([1, 1, n_i, d], [1, 1, n_i, d])`` head ``head``'s live keys and values (views)."""
        live = self.live(head)
        return self.k[:, :, live], self.v[:, :, live]

    def live_rows(self, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([n_i, d], [n_i, d])`` head ``head``'s live keys and values (views)."""
        live = self.live(head)
        return self._rows[0][live], self._rows[1][live]

    def live_values(self, x: torch.Tensor) -> torch.Tensor:
        """``[held]``: a per-slot row ``x`` (``[1, 1, capacity]``) at the live slots, head after head."""
        return torch.cat([x[0, 0, self.live(i)] for i in range(self.heads)])

    def head_positions(self) -> list[torch.Tensor]:
        """Per KV head, ``[n_i]`` the original positions of its live slots (slot order)."""
        return [self.pos[0, 0, self.live(i)] for i in range(self.heads)]

    def held(self) -> int:
        """Live slots over all heads."""
        return sum(self.counts)

    # -- changes -----------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor, first: int, norms: torch.Tensor | None = None) -> None:
        """Write ``[1, kv_heads, q, d]`` new keys/values, positions ``first .. first + q - 1``, after each
        head's live slots (its region grows first when full); ``norms`` ``[1, kv_heads, q, g]`` with :attr:`norm`."""
        q = keys.shape[2]
        if any(n + q > c for n, c in zip(self.counts, self.capacities)):
            self._regrow(q)
        index = torch.tensor([start + n + j for start, n in zip(self.offsets, self.counts) for j in range(q)],
                             device=self.k.device)
        k, v, pos = self._rows[:3]
        k[index] = keys[0].reshape(-1, keys.shape[-1])
        v[index] = values[0].reshape(-1, values.shape[-1])
        if q == 1:
            pos.index_fill_(0, index, first)
        else:
            pos[index] = torch.arange(first, first + q, device=self.k.device).repeat(self.heads)
        if self.state is not None:
            self.state[0, 0].index_fill_(0, index, 0)
        if self.norm is not None and norms is not None:
            self.norm[0, 0, index] = norms[0].reshape(-1, norms.shape[-1])
        self.counts = [n + q for n in self.counts]

    def _regrow(self, q: int) -> None:
        lives = [self.live(i) for i in range(self.heads)]
        self._build([self.k[0, 0, s] for s in lives], [self.v[0, 0, s] for s in lives],
                    [self.pos[0, 0, s] for s in lives],
                    None if self.state is None else [self.state[0, 0, s] for s in lives], [q] * self.heads,
                    None if self.norm is None else [self.norm[0, 0, s] for s in lives])

    def evict(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Drop the row's ``slots`` ``[e]`` (live, distinct): in each region the live slots above its new
        count fill the holes below it, so the region stays contiguous.

        Returns ``(slots, heads, positions)``, each ``[e]``: the dropped slots (their indices before the
        move), their KV heads and original positions, head by head.
        """
        device = self.k.device
        freed = sorted(slots.tolist())
        by_head: dict[int, list[int]] = {}
        for s in freed:  # regions lie in head order: a slot's head is the last region starting at or before it
            by_head.setdefault(bisect.bisect_right(self.offsets, s) - 1, []).append(s)
        order = torch.tensor(freed, dtype=torch.long, device=device)
        heads = torch.tensor([head for head, gone in by_head.items() for _ in gone], device=device)
        positions = self.pos[0, 0, order]
        holes, movers, dead = [], [], []
        for head, gone in by_head.items():
            start, n = self.offsets[head], self.counts[head]
            k = n - len(gone)
            out = set(gone)
            holes += [s for s in gone if s < start + k]
            movers += [t for t in range(start + k, start + n) if t not in out]
            dead += range(start + k, start + n)
            self.counts[head] = k
        if holes:
            src, dst = torch.tensor(movers, device=device), torch.tensor(holes, device=device)
            self._move(src, dst)
        self._rows[2][torch.tensor(dead, dtype=torch.long, device=device)] = -1
        return order, heads, positions

    def evict_over_budget(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every head above its budget drops its lowest-scored live slots (``scores`` ``[capacity]``; ties: the
        lower position, at a decode step's one slot per head the newest), as :meth:`evict` returns them."""
        if self.excess() == 1:  # the decode step: the region's last live slot fills the hole
            return self._evict_lowest(scores)
        return self.evict(select_evict_by_head(scores, self._rows[2], self.owner[0, 0], self.budget_tensor,
                                               self.counts))

    def _evict_lowest(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One slot out of each head over its budget by one: the lowest-scored live one, ties to the newest
        (as :func:`select_evict_by_head` picks at a decode step, by a few ops per head instead of ~20 on the row)."""
        pos = self._rows[2]
        holes, lasts, heads = [], [], []
        for head, (start, n, budget) in enumerate(zip(self.offsets, self.counts, self.budgets)):
            if n <= budget:
                continue
            region = scores[start : start + n]
            holes.append(start + int(torch.where(region == region.min(), pos[start : start + n], -1).argmax()))
            lasts.append(start + n - 1)
            heads.append(head)
            self.counts[head] = n - 1
        m = len(holes)
        packed = torch.tensor(holes + lasts + heads, device=self.k.device)  # one tensor (each costs ~7 us), three views
        dst, src = packed[:m], packed[m : 2 * m]
        positions = pos[dst]
        self._move(src, dst)
        pos[src] = -1
        return dst, packed[2 * m :], positions

    def _move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` ``[m]`` onto slots ``dst`` ``[m]`` in every per-slot buffer, the policy's state included."""
        for row in self._rows if self.state is None else (*self._rows, self.state[0, 0]):
            row[dst] = row[src]

    def excess(self) -> int:
        """The most slots any head holds above its budget (0 or less: none to evict)."""
        return max(n - b for n, b in zip(self.counts, self.budgets))

    def nbytes(self) -> int:
        """Bytes of the live keys and values."""
        return 2 * self.held() * self.k.shape[-1] * self.k.element_size()

    def allocated_bytes(self) -> int:
        """Bytes of the key and value buffers, free room included."""
        return 2 * self.k.numel() * self.k.element_size()
