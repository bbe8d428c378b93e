"""Train the ``kvzap`` policy's surrogate from KVzip+ scores (``sparseety learn-policy --target kvzip``).

Data. Each traced request's prompt (tier 2 or 3: lower tiers store no token ids; any policy) is a context: its first ``max_context`` token
ids. The trainer feeds the context followed by KVzip's reconstruction prompt and the context again
(:meth:`KVzipPolicy.reconstruction_chunks`: "Repeat the previous context exactly.", the chat template's
turn suffix, the context) as one teacher-forced forward on the model the traces name, dense, through
the engine with a capture policy. Per layer it keeps the hidden states that entered the attention block
at each context token (what ``kvzap`` reads at prefill) and its **KVzip+ score** per KV head, as kvpress's
``kvzap/train.py`` defines it: with ``a[h, t, i]`` the causal softmax attention of repeated-context row
``t`` on context token ``i`` in query head ``h`` (over every key, one forward),

    ``s[k, i] = log max over t and the query heads h of KV group k of  a[h, t, i] * ||W_O^h v_i|| / ||x_t||``

(``x_t`` row ``t``'s attention-input hidden state, ``W_O^h`` head ``h``'s slice of the output projection,
``v_i`` the token's value), floored at ``log 1e-9``. The chat template's header (before the repeated
part) is not scored. On a hybrid model (Gemma 3) the sliding layers are scored the same way, without
their window (their keys beyond it are gone at run time anyway; they evict only below the window).

Fit. Per layer a ridge regression (``alpha`` 1, with intercept, kvpress's ``Ridge()``) from the hidden state
to the ``K`` scores, solved exactly from streamed sums over every training token; or (``surrogate="mlp"``)
a two-layer GELU MLP trained with AdamW on the MSE over a subsample. Requests are split into training and
held-out ones by a seeded shuffle (:func:`sparseety.training.learned_policy.split_requests`).

Held-out fidelity, per layer: Spearman's rank correlation of predicted and true scores over each
held-out context's (token, KV head) pairs, and the recall of KVzip+'s kept set at ratio 0.5 (per KV head
the top half of the tokens by the true score; the share of them the top half by prediction keeps),
both averaged over the held-out requests. With no request held out (``holdout`` 0, or a single request)
nothing is measured: the per-layer figures are empty and the provenance's held-out figures null.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from sparseety.training.learned_policy import check_trace_dir
from sparseety.errors import InputError
from sparseety.policies.base import Observation, Policy, Signal
from sparseety.policies.parts.kvzap_model import Surrogate
from sparseety.policies.kvzip import KVzipPolicy

FLOOR = 1e-9
ROW_BLOCK = 256


@dataclass
class Context:
    """One traced request's prompt, the text a surrogate trains on."""

    request_id: str
    model: str
    token_ids: list[int]


def read_contexts(trace_dir: str | Path, model: str | None = None, max_context: int = 2048,
                  min_context: int = 32) -> list[Context]:
    """Every tier-2 or tier-3 request of the dataset (of ``model`` only, when given), oldest first: its first
    ``max_context`` prompt token ids (requests with fewer than ``min_context`` are skipped; tier 0 and 1 store
    no token ids).

    Raises
    ------
    InputError
        A file or no directory, no trace of ``model``, only traces without token ids, no prompt long enough,
        or several models and no ``model`` chosen.
    """
    from sparseety.store import connect, load_trace

    root = check_trace_dir(trace_dir)
    record = f"record some with `sparseety run --policy dense --tier 2 --trace-dir {root} ...`"
    rows = connect(root).sql("SELECT request_id, model, tier FROM requests ORDER BY created_at, request_id").fetchall()
    if model is not None:
        found = sorted({r[1] for r in rows})
        rows = [r for r in rows if r[1] == model]
        if not rows:
            raise InputError(f"no traces of model {model!r} in {root} (--model); it holds traces of "
                             f"{', '.join(found) if found else 'no model'}")
    models = sorted({r[1] for r in rows})
    if len(models) > 1:
        raise InputError(f"{root} holds traces of several models ({', '.join(models)}); choose one with --model")
    stored = [r for r in rows if r[2] >= 2]  # tier 0 and 1 store counts and timings, no token ids
    if rows and not stored:
        raise InputError(f"the {len(rows)} traces in {root} are tier {'/'.join(str(t) for t in sorted({r[2] for r in rows}))}, "
                         f"which store no prompt token ids; --target kvzip needs tier 2 or 3 traces ({record})")
    out = []
    for request_id, name, _tier in stored:
        ids = list(load_trace(root, request_id).document["prompt_token_ids"])[:max_context]
        if len(ids) >= min_context:
            out.append(Context(request_id=request_id, model=name, token_ids=ids))
    if not out:
        raise InputError(f"no traced prompts of at least {min_context} tokens in {root} ({record})")
    return out



def kvzip_plus(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden_rows: torch.Tensor,
               grams: torch.Tensor, scaling: float, start: int, end: int) -> torch.Tensor:
    """Log KVzip+ scores ``[kv_heads, end - start]`` of the context slots ``start .. end - 1``.

    Parameters
    ----------
    queries : ``[1, heads, r, d]`` the repeated-context rows, the last ``r`` of the forward (RoPE applied).
    keys, values : ``[1, kv_heads, n, d]`` every slot of the forward (the last ``r`` are the rows' own).
    hidden_rows : ``[r, D]`` the rows' attention-input hidden states.
    grams : ``[kv_heads, g, d, d]`` per query head ``W_O^hT W_O^h``.
    """
    _, h, r, d = queries.shape
    kvh, n = keys.shape[1], keys.shape[2]
    g = h // kvh
    v = values[0, :, start:end].float()  # [kvh, c, d]
    wov = torch.einsum("kcd,kgde,kce->kgc", v, grams.float(), v).clamp(min=0).sqrt()  # [kvh, g, c]
    inv_norm = 1.0 / hidden_rows.float().norm(dim=-1).clamp(min=1e-12)  # [r]
    key_t = keys[0].float().transpose(-1, -2)  # [kvh, d, n]
    best = torch.zeros(kvh, end - start)
    for first in range(0, r, ROW_BLOCK):
        rows = queries[0, :, first : first + ROW_BLOCK].float()  # [h, b, d]
        b = rows.shape[1]
        logits = torch.matmul(rows.reshape(kvh, g * b, d), key_t).view(kvh, g, b, n) * scaling
        where = n - r + first + torch.arange(b).unsqueeze(1)  # each row's own slot
        logits = logits.masked_fill(torch.arange(n).unsqueeze(0) > where, float("-inf"))
        probs = torch.softmax(logits, dim=-1)[..., start:end]  # [kvh, g, b, c]
        weighted = probs * wov.unsqueeze(2) * inv_norm[first : first + b].view(1, 1, b, 1)
        best = torch.maximum(best, weighted.amax(dim=(1, 2)))
    return best.clamp(min=FLOOR).log()


@dataclass
class _Capture(Policy):
    """Evicts nothing (no budget): per layer keeps the context tokens' hidden states and KVzip+ scores."""

    name: ClassVar[str] = "kvzap-capture"
    prefill_signal: ClassVar[Signal] = Signal.NONE
    decode_signal: ClassVar[Signal] = Signal.NONE
    needs_hidden: ClassVar[bool] = True
    rows: int = 1
    start: int = 0
    end: int = 0
    grams: list[torch.Tensor] = field(default_factory=list)
    scalings: list[float] = field(default_factory=list)
    out: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def query_rows(self) -> int:
        return self.rows

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert obs.queries is not None and obs.values is not None and obs.hidden is not None
        hidden = obs.hidden[0]
        y = kvzip_plus(obs.queries, obs.keys, obs.values, hidden[-self.rows:], self.grams[obs.layer],
                       self.scalings[obs.layer], self.start, self.end)
        self.out[obs.layer] = (hidden[self.start : self.end].float().cpu().clone(), y.cpu())
        return torch.zeros(obs.positions.shape), None


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's attention modules, by layer."""
    return sorted((m for m in model.modules() if hasattr(m, "o_proj") and isinstance(getattr(m, "layer_idx", None), int)),
                  key=lambda m: m.layer_idx)


def capture(engine: Any, context: Context) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(x [c, D], y [kv_heads, c])`` of one context (see the module docstring)."""
    from sparseety.engine import EncodedInput

    (chunk,) = KVzipPolicy(chunk_size=len(context.token_ids)).reconstruction_chunks(context.token_ids, engine.tokenizer)
    ids = torch.tensor([context.token_ids + list(chunk.ids)], dtype=torch.long)
    policy = _Capture(rows=chunk.end - chunk.start, start=chunk.start, end=chunk.end, grams=engine.output_grams(),
                      scalings=[float(m.scaling) for m in attention_modules(engine.model)])
    with engine.open_run(EncodedInput(input_ids=ids), policy, tier=0) as ctx:
        engine.model(input_ids=ids, past_key_values=ctx.cache, use_cache=True, logits_to_keep=1)
    return policy.out


@dataclass
class KVzapConfig:
    surrogate: str = "linear"
    alpha: float = 1.0  #: ridge penalty (linear)
    hidden: int = 16  #: MLP width (mlp)
    epochs: int = 30
    lr: float = 3e-3
    max_examples: int = 4000  #: MLP: training tokens at most (evenly subsampled)
    max_context: int = 2048
    holdout: float = 0.25
    seed: int = 0


class _RidgeSums:
    """Streamed sums of one layer for the exact ridge solution."""

    def __init__(self, d: int, k: int) -> None:
        self.xx, self.xy = torch.zeros(d, d, dtype=torch.float64), torch.zeros(d, k, dtype=torch.float64)
        self.x, self.y, self.n = torch.zeros(d, dtype=torch.float64), torch.zeros(k, dtype=torch.float64), 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        self.xx += x.T @ x
        self.xy += x.T @ y
        self.x += x.sum(0)
        self.y += y.sum(0)
        self.n += x.shape[0]

    def solve(self, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
        mx, my = self.x / self.n, self.y / self.n
        xx = self.xx - self.n * torch.outer(mx, mx)
        xy = self.xy - self.n * torch.outer(mx, my)
        w = torch.linalg.solve(xx + alpha * torch.eye(xx.shape[0], dtype=xx.dtype), xy)
        return w.float(), (my - mx @ w).float()


def fit_mlp(xs: list[torch.Tensor], ys: list[torch.Tensor], config: KVzapConfig) -> dict[str, torch.Tensor]:
    """Per layer a GELU MLP (``config.hidden`` wide) on ``xs[l]`` ``[N, D]`` -> ``ys[l]`` ``[N, K]``, AdamW on the MSE."""
    gen = torch.Generator().manual_seed(config.seed)
    w1s, b1s, w2s, b2s = [], [], [], []
    for x, y in zip(xs, ys):
        d, h, k = x.shape[1], config.hidden, y.shape[1]
        w1 = (torch.randn(d, h, generator=gen) / math.sqrt(d)).requires_grad_()
        b1 = torch.zeros(h, requires_grad=True)
        w2 = (torch.randn(h, k, generator=gen) / math.sqrt(h)).requires_grad_()
        b2 = y.mean(0).clone().requires_grad_()
        opt = torch.optim.AdamW([w1, b1, w2, b2], lr=config.lr)
        for _ in range(config.epochs):
            order = torch.randperm(x.shape[0], generator=gen)
            for first in range(0, x.shape[0], 512):
                idx = order[first : first + 512]
                loss = torch.nn.functional.mse_loss(torch.nn.functional.gelu(x[idx] @ w1 + b1) @ w2 + b2, y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        w1s.append(w1.detach()), b1s.append(b1.detach()), w2s.append(w2.detach()), b2s.append(b2.detach())
    return {"w1": torch.stack(w1s), "b1": torch.stack(b1s), "w2": torch.stack(w2s), "b2": torch.stack(b2s)}


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman's rank correlation of two flat tensors (ties ranked by position)."""
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp(min=1e-12))


def kept_recall(pred: torch.Tensor, true: torch.Tensor, ratio: float = 0.5) -> float:
    """Per KV head (rows of ``[K, c]``), the share of the true top ``1 - ratio`` kept by the predicted top; the mean."""
    keep = max(1, int(true.shape[-1] * (1 - ratio)))
    out = []
    for p, t in zip(pred, true):
        chosen = torch.zeros_like(t, dtype=torch.bool)
        chosen[p.topk(keep).indices] = True
        out.append(float(chosen[t.topk(keep).indices].float().mean()))
    return float(np.mean(out))


@dataclass
class KVzapResult:
    surrogate: Surrogate
    per_layer: list[dict[str, float]]  #: held-out ``{"layer", "spearman", "recall@0.5"}``; empty when none held out
    train_requests: list[str]
    heldout_requests: list[str]
    tokens: int


def learn_kvzap(engine: Any, contexts: Sequence[Context], config: KVzapConfig, *, trace_dir: str, text_source: str,
                on_progress: Callable[[str], None] | None = None) -> KVzapResult:
    """Capture, fit and evaluate (see the module docstring); the surrogate with its provenance filled in."""
    from sparseety.version import __version__
    from sparseety.training.learned_policy import NO_HELDOUT, split_requests
    from sparseety.fingerprint import config_summary, model_fingerprint

    say = on_progress or (lambda _m: None)
    info = engine.model_info
    train_idx, held_idx = split_requests(contexts, config.holdout, config.seed)  # type: ignore[arg-type]
    sums: list[_RidgeSums] = []
    samples: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(info.num_layers)]
    per_request = max(1, config.max_examples // max(1, len(train_idx)))
    tokens = 0
    for i, index in enumerate(train_idx):
        captured = capture(engine, contexts[index])
        for layer in range(info.num_layers):
            x, y = captured[layer]
            if config.surrogate == "linear":
                if not sums:
                    sums = [_RidgeSums(x.shape[1], y.shape[0]) for _ in range(info.num_layers)]
                sums[layer].add(x, y.T)
            else:
                pick = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(config.seed + index))[:per_request]
                samples[layer].append((x[pick], y.T[pick]))
        tokens += captured[0][0].shape[0]
        say(f"captured training request {i + 1}/{len(train_idx)} ({len(contexts[index].token_ids)} tokens)")
    if config.surrogate == "linear":
        solved = [s.solve(config.alpha) for s in sums]
        d = solved[0][0].shape[0]
        weights = {"w1": torch.zeros(info.num_layers, d, 0), "b1": torch.zeros(info.num_layers, 0),
                   "w2": torch.stack([w for w, _ in solved]), "b2": torch.stack([b for _, b in solved])}
    else:
        say(f"fitting {info.num_layers} MLPs of width {config.hidden}")
        weights = fit_mlp([torch.cat([x for x, _ in s]) for s in samples],
                          [torch.cat([y for _, y in s]) for s in samples], config)
    fingerprint = model_fingerprint(engine.model)
    surrogate = Surrogate(**weights, model=contexts[0].model, model_fingerprint=fingerprint)
    rho: list[list[float]] = [[] for _ in range(info.num_layers)]
    recall: list[list[float]] = [[] for _ in range(info.num_layers)]
    for i, index in enumerate(held_idx):  # only requests the fit never saw; none held out: no figure at all
        captured = capture(engine, contexts[index])
        for layer in range(info.num_layers):
            x, y = captured[layer]
            pred = surrogate(layer, x.unsqueeze(0))[0]  # [K, c]
            rho[layer].append(spearman(pred.reshape(-1), y.reshape(-1)))
            recall[layer].append(kept_recall(pred, y))
        say(f"evaluated held-out request {i + 1}/{len(held_idx)}")
    per_layer = [{"layer": layer, "spearman": round(float(np.mean(rho[layer])), 4),
                  "recall@0.5": round(float(np.mean(recall[layer])), 4)} for layer in range(info.num_layers)] \
        if held_idx else []
    mean = {"spearman": round(float(np.mean([r["spearman"] for r in per_layer])), 4),
            "recall@0.5": round(float(np.mean([r["recall@0.5"] for r in per_layer])), 4)} if per_layer else None
    surrogate.provenance = {
        "sparseety_version": __version__,
        "model": contexts[0].model,
        "model_fingerprint": fingerprint,
        "model_config": config_summary(engine.model),
        "target": "log KVzip+ score per KV head (kvpress kvzap/train.py): max over the repeated-context rows and "
                  "the KV group's heads of attention x ||W_O v|| / ||x_row||, floored at 1e-9",
        "inputs": "the hidden states entering each layer's attention block",
        "trace_dir": str(trace_dir),
        "text_source": text_source,
        "requests": len(contexts),
        "train_request_ids": [contexts[i].request_id for i in train_idx],
        "heldout_request_ids": [contexts[i].request_id for i in held_idx],
        "training_tokens": tokens,
        "config": dataclasses.asdict(config),
        "heldout": per_layer or None,
        "heldout_mean": mean,
        "metrics_on": "held-out requests" if held_idx else NO_HELDOUT,
    }
    return KVzapResult(surrogate=surrogate, per_layer=per_layer,
                       train_requests=[contexts[i].request_id for i in train_idx],
                       heldout_requests=[contexts[i].request_id for i in held_idx], tokens=tokens)
