"""``kvzip``: KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction").

After the region's prefill (the prompt, or under the long-document protocol the context) the model is
made to repeat the context, teacher-forced: ``"\\n\\nRepeat the previous context exactly."``, the chat
template's turn suffix, then the context tokens, fed over the cache that holds the context's KV. The
attention each context slot receives from those reconstruction queries is its importance. The pass
writes no token and its own KV is discarded (the cache returns to exactly the context's slots); then
each layer keeps its budget by those scores. Follows kvpress's ``KVzipPress`` (0.5.5), but evicts for
real (kvpress masks the pruned keys and keeps every slot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sparseety.errors import ConfigError
from sparseety.policies.base import (Observation, Policy, ReconstructionChunk, Signal, check_positive_int, protect,
                                     recent_mask, share_heads, share_layers)

REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
REPEAT_PART_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
#: Tokens of the previous chunk quoted after :data:`REPEAT_PART_PROMPT` (kvpress's ``prev_postfix_size``).
PREVIOUS_TAIL = 8


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def template_parts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """``(prefix_ids, suffix_ids)``: the chat template's text before a user turn's content and after it
    (with the assistant prefix), found as kvpress does with a dummy context; ``([], ids of "\\n")``
    without a template."""
    if not getattr(tokenizer, "chat_template", None):
        return [], _encode(tokenizer, "\n")
    dummy = "dummy context"
    separator = "\n" + "#" * len(dummy)
    text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + separator}],
                                         add_generation_prompt=True, tokenize=False, enable_thinking=False)
    before, suffix = text.split(separator)
    return _encode(tokenizer, before.split(dummy)[0]), _encode(tokenizer, suffix)


@dataclass
class KVzipPolicy(Policy):
    """Score each context slot by the attention it gets while the model reconstructs the context.

    The score of a slot is the maximum, over the reconstruction query rows and the query heads of its
    KV group, of the attention probability it receives; as in kvpress the softmax runs over the
    first ``sinks`` slots, the chunk being reconstructed and the reconstruction's own (causal) keys
    only, and a context longer than ``chunk_size`` tokens is reconstructed ``chunk_size`` tokens per
    forward (later chunks quote the previous chunk's last 8 tokens after "Repeat the part of the
    previous context exactly, starting with"). With ``attend="full"`` (the default, kvpress's) each
    reconstruction row still attends to the whole context to compute its output; ``attend="chunk"``
    restricts that attention to the scoring set itself (the sinks, the chunk and the own keys), so a
    chunk is repeated from itself: the same scoring rule over hidden states computed without the
    rest of the context. It skips most of the pass's attention (on 7k tokens the pass costs about
    1.1x a dense prefill instead of 1.9x), is no longer kvpress's computation, and can lose what only
    the other chunks' context makes a slot matter for (one of two solved 4k-token passkey cases).
    The chat template's header (the tokens before the user's content, when the context starts with
    them) is not repeated and scores 0. The first ``sinks`` positions are always kept.

    Tensor shapes: the prefill observation's ``attention`` is ``[b, kv_heads, n]`` (the
    reconstruction scores, slot order = position order); ``state`` ``[b, kv_heads, n]``.

    Decode steps (plain prompts; the long-document protocol never evicts after the context) keep the
    budget by evicting one slot per step: every slot's score is max-accumulated with the group-mean
    attention each decode row gives it (the same "most attention ever received" rule as the
    reconstruction), and the newest ``window`` positions are protected so the answer being written
    is never cut. Costs one extra teacher-forced pass over the context at prefill.

    Budgets across layers and heads. By default (``per_head=true``, kvpress's ``KVzipPress``) one
    ranking over every (layer, KV head, slot) of the layers that compress keeps the best ``sum of
    budgets x KV heads`` slots (ties: the lower layer, head, position; each head's best slot first, so
    every head keeps at least one),
    so each head keeps its own count. Unlike kvpress, which masks the rest and holds every slot, the
    engine evicts them and stores such a layer per head (each head a buffer of its own), so memory is
    the kept slots: the same total as uniform budgets. ``layerwise=true`` ranks within each layer
    instead (its budget x KV heads). ``per_head=false`` keeps every head of a layer at the same
    count: the layers share their summed budget by score (greedy on each layer's next slot's gain,
    its heads' next-best scores summed, exact since a layer's gains only decrease), or with
    ``layerwise=true`` keep uniform budgets. Plain prompts then evict per head while decoding, each
    head down to its own count.
    """

    name: ClassVar[str] = "kvzip"
    summary: ClassVar[str] = "max attention while the model repeats the context, one extra pass (KVzip)"
    prefill_signal: ClassVar[Signal] = Signal.NONE
    decode_signal: ClassVar[Signal] = Signal.LAST_ROW
    reconstructs: ClassVar[bool] = True

    sinks: int = 4
    chunk_size: int = 2048
    window: int = 32
    layerwise: bool = False
    per_head: bool = True
    attend: str = "full"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive_int(self.name, "sinks", self.sinks, minimum=0)
        check_positive_int(self.name, "chunk_size", self.chunk_size)
        check_positive_int(self.name, "window", self.window, minimum=0)
        for option in ("layerwise", "per_head"):
            if not isinstance(getattr(self, option), bool):
                raise ConfigError(f"{self.name}: {option} must be true or false, got {getattr(self, option)!r}")
        if self.attend not in ("full", "chunk"):
            raise ConfigError(f"{self.name}: attend must be 'full' or 'chunk', got {self.attend!r}")

    @property
    def splits_heads(self) -> bool:
        return self.per_head

    def reconstruction_chunks(self, context_ids: list[int], tokenizer: Any) -> list[ReconstructionChunk]:
        """The reconstruction forwards for a region holding ``context_ids`` (in order)."""
        prefix, suffix = template_parts(tokenizer)
        start = len(prefix) if prefix and context_ids[: len(prefix)] == prefix else 0
        body = context_ids[start:]
        pieces = [body[i : i + self.chunk_size] for i in range(0, len(body), self.chunk_size)]
        chunks = []
        for i, piece in enumerate(pieces):
            if i == 0:
                prompt = _encode(tokenizer, REPEAT_PROMPT)
            else:
                prompt = _encode(tokenizer, REPEAT_PART_PROMPT) + pieces[i - 1][-PREVIOUS_TAIL:]
            chunks.append(ReconstructionChunk(tuple(prompt + suffix + piece), start, start + len(piece),
                                              min(self.sinks, start), self.attend == "chunk"))
            start += len(piece)
        return chunks

    def allocate(self, scores: dict[int, torch.Tensor], budgets: dict[int, int]) -> dict[int, int | list[int]]:
        """Budgets for the layers in ``scores`` (each ``[b, kv_heads, n]``, after :meth:`score`).

        ``budgets`` are the uniform ones. With ``per_head``, per layer one count per KV head;
        otherwise one count per layer: ``layerwise`` returns the budgets, else their sum is shared out
        by score over all these layers together (see the class docstring).
        """
        if self.per_head and scores:
            return share_heads(scores, budgets, across_layers=not self.layerwise)
        if self.layerwise or len(scores) < 2:
            return dict(budgets)
        # what a layer's (j+1)-th slot per head adds: its heads' (j+1)-th best scores summed
        return dict(share_layers(scores, budgets, lambda ranked: ranked.sum(dim=(0, 1))))

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert obs.attention is not None
        if obs.prefill or obs.state is None:
            state = obs.attention
        else:
            state = torch.maximum(obs.state, obs.attention)
        protected = obs.positions < self.sinks
        if not obs.prefill:
            protected |= recent_mask(obs.positions, min(self.window, self.budget or 0))
        return protect(state, protected), state
