"""``ForwardState``: what one model forward is, for one sequence (the per-step part of the run context).

Made at the start of every forward from the tokens seen and fed (:meth:`ForwardState.begin`): its
phase (prompt or decode, a prefill chunk that does not complete the region), whether the policy
scores and evicts after it, the drafts it carries, and the rows the hook point computes per layer
(:meth:`ForwardState.forward_plan`, made once per forward). Shapes: ``b`` sequences, ``q`` rows
fed, ``D`` hidden size, ``kv_heads`` KV heads, ``n`` slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sparseety.engine.settings import RunSettings
from sparseety.engine.signals import LayerPlan
from sparseety.policies.base import Policy, Signal


@dataclass
class ForwardState:
    """The state of the forward in progress (reset by :meth:`begin`, read by every layer)."""

    index: int = -1  #: forwards begun so far minus one (a reconstruction pass counts none)
    step: int = 0  #: 0 for the prompt, then the output token this forward produces
    q_len: int = 0  #: tokens fed
    drafts: int = 0  #: speculative drafts among them (fed beyond the one(s) this forward must process)
    prompt: bool = True  #: it feeds prompt tokens (a prefill, or a chunk of one)
    partial_prefill: bool = False  #: a prefill chunk that does not complete the prompt (or the context)
    choosing_layer: bool = False  #: the forward whose last row chooses the ``auto`` layer
    evicting: bool = False  #: the policy scores and evicts after each layer's attention
    carrying: bool = False  #: an earlier prefill chunk: the policy's signals are kept for the completing chunk
    emits: bool = False  #: its newest row produces an output token
    rows: tuple[int, int] = (0, 0)  #: (first row of this forward, rows of the region it belongs to)
    stacked: bool = False  #: every layer's one-slot eviction runs at its end, at once (:mod:`.stacked`)
    reconstruct_after: bool = False  #: it completes a region a reconstructing policy (kvzip) scores after it
    plan: LayerPlan | None = None  #: what every layer computes (made by the first layer)
    recording_plan: LayerPlan | None = None  #: the same plus the newest row, for layers recording importance
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  #: per layer ``[b, q, D]`` hidden states, for the policy
    shared_scores: dict[int, torch.Tensor] = field(default_factory=dict)  #: per layer ``[b, kv_heads, n]``, shared out at its end

    def begin(self, settings: RunSettings, seen: int, q_len: int) -> int | None:
        """A forward feeding ``q_len`` tokens after ``seen``: set its phase and what the policy does after it.

        Returns the end of the region this forward completes when a reconstructing policy scores that
        region in passes of its own (its eviction is deferred to them), else None.
        """
        input_len, policy = settings.input_len, settings.policy
        compress_once = settings.compress_len is not None
        self.index += 1
        self.q_len = q_len
        self.plan = self.recording_plan = None
        self.prompt = seen < input_len
        self.step = max(0, seen + 1 - input_len)
        context_end = settings.compress_len if settings.compress_len is not None else input_len
        region_end = context_end if seen < context_end else input_len  # the context, else the prompt
        self.partial_prefill = self.prompt and seen + q_len < region_end
        self.emits = seen + q_len >= input_len
        self.choosing_layer = seen < context_end <= seen + q_len
        self.rows = (seen, region_end)
        scoring = not compress_once or seen < context_end  # the long-document protocol compresses the context only
        self.evicting = policy.evicts and scoring and not self.partial_prefill
        self.carrying = policy.evicts and scoring and self.partial_prefill
        self.drafts = max(0, q_len - max(1, input_len - seen))
        # A reconstructing policy scores the completed region in passes of its own, after this forward (none
        # when the long-document protocol's context fits every budget: nothing is ever evicted then).
        self.reconstruct_after = False
        if not (policy.reconstructs and self.evicting and self.prompt):
            return None
        self.evicting = False
        self.reconstruct_after = not compress_once or any(
            (b := policy.layer_budget(layer, settings.num_layers, region_end)) is not None and b < region_end
            for layer in range(settings.num_layers))
        return region_end

    def forward_plan(self, policy: Policy, q: int, attention_topk: int | None) -> LayerPlan:
        """What every layer computes for this forward's ``q`` queries (made once, then reused)."""
        if self.plan is None:
            signal = Signal.NONE
            if self.evicting or self.carrying:
                signal = policy.prefill_signal if self.prompt else policy.decode_signal
            first, region_end = self.rows
            window_rows = 0
            if signal is Signal.WINDOW:  # this forward's rows among the region's last ``window`` rows
                window_rows = max(0, min(q, first + q - max(first, region_end - policy.window_rows())))
            self.plan = LayerPlan(
                last_row=signal is Signal.LAST_ROW and not self.carrying,
                window_rows=window_rows,
                # a prefill chunk samples the rows of its whole region, a decode step its own rows
                colsum_stride=policy.colsum_stride(region_end if self.prompt else q)
                if signal is Signal.COLSUM else 0,
                topk=None if self.prompt else (policy.budget if policy.attends_topk else attention_topk),
                colsum_last=region_end - 1 - first if self.prompt else q - 1,
                query_rows=self._query_rows(policy, q),
            )
        return self.plan

    def _query_rows(self, policy: Policy, q: int) -> int:
        """This forward's query rows the policy reads: at a prefill, those among the region's last ``query_rows()``."""
        wanted = policy.query_rows() if self.evicting or self.carrying else 0
        if wanted <= 0:
            return 0
        if not self.prompt:
            return min(q, wanted)
        first, region_end = self.rows
        return max(0, min(q, first + q - max(first, region_end - wanted)))
