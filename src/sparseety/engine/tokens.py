"""``TokenRecord``: the token ids a run was fed and the drafts among them (the token part of the run context).

The ids are kept only for policies that read them (:attr:`~sparseety.policies.base.Policy.needs_token_ids`);
the drafts (speculative tokens fed beyond the one a step must process) at tier >= 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class TokenRecord:
    """Token ids fed so far and the speculative drafts among them."""

    ids: torch.Tensor | None = None  #: ``[b, seen]`` long, ids fed so far (-1 where unknown), kept only when needed
    drafts: list[tuple[int, int, int, int]] = field(default_factory=list)  #: per drafted token: (forward, step, position, token_id)
    draft_tokens: int = 0  #: drafted tokens fed, every tier

    def feed(self, seen: int, q_len: int, input_ids: torch.Tensor | None) -> None:
        """Write a forward's token ids ``[b, >= q_len]`` at positions ``seen .. seen + q_len`` (-1 when not
        given, e.g. embeddings)."""
        ids = torch.full((1, q_len), -1, dtype=torch.long) if input_ids is None else input_ids[:, -q_len:].long().cpu()
        held = self.ids
        if held is None or held.shape[0] != ids.shape[0]:
            held = torch.full((ids.shape[0], 0), -1, dtype=torch.long)
        if held.shape[1] < seen + q_len:
            grown = torch.full((ids.shape[0], seen + q_len), -1, dtype=torch.long)
            grown[:, : min(seen, held.shape[1])] = held[:, :seen]
            held = grown
        held[:, seen: seen + q_len] = ids
        self.ids = held

    def slot_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """``[b, kv_heads, n]`` token id of every slot (positions ``[b, kv_heads, n]``), -1 where unknown."""
        held = self.ids
        if held is None:
            return torch.full_like(positions, -1)
        where = positions.cpu().long()
        b = where.shape[0]
        rows = held if held.shape[0] == b else held[:1].expand(b, -1)
        ids = rows.gather(1, where.reshape(b, -1).clamp(0, max(0, held.shape[1] - 1))).reshape(where.shape)
        return torch.where(where < held.shape[1], ids, -1).to(positions.device)

    def add_drafts(self, forward: int, step: int, first: int, count: int, input_ids: torch.Tensor | None) -> None:
        """Record a forward's ``count`` drafted tokens, the last of ``input_ids`` ``[b, q]`` (-1 when not given),
        at positions ``first ..``."""
        ids = input_ids[0, -count:].tolist() if input_ids is not None else [-1] * count
        self.drafts.extend((forward, step, first + i, token) for i, token in enumerate(ids))

    def outcomes(self, sequence: list[int]) -> dict[str, np.ndarray]:
        """Per drafted token: ``drafted.{step,position,token_id,rejected}`` given the final ``sequence``.

        Generation is greedy, so a draft is accepted exactly when it and every earlier draft of its
        forward equal the tokens the sequence holds at their positions.
        """
        rows, forward, agreeing = [], None, True
        for index, step, position, token in self.drafts:
            if index != forward:
                forward, agreeing = index, True
            agreeing = agreeing and position < len(sequence) and sequence[position] == token
            rows.append((step, position, token, 0 if agreeing else 1))
        table = np.asarray(rows, dtype=np.int64).reshape(-1, 4)
        return {f"drafted.{name}": table[:, i] for i, name in enumerate(("step", "position", "token_id", "rejected"))}
