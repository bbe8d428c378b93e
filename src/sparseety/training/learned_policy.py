"""Train the ``learned`` policy's predictor from tier-3 traces (``sparseety learn-policy``).

Data. Each tier-3 trace holds ``step_importance`` ``[steps, layers, seen]``: for every forward that
completed the prompt (or the context) and every later step, the attention the newest query gave each
position, averaged over heads. Row 0 is the prefill's last row; its width is the prefill length ``C``
(the context, under the long-document protocol). The **label** of position ``p < C`` in layer ``l`` is
the attention it receives from *later* steps (the question forward's newest row and each decode step):
by default the most any one of them gave it (``label="max"``: a position one answer token needed
counts, as KVzip scores by its maximum), their sum (``label="sum"``), or the question forward's row
alone (``label="question"``: the first row after the prefill, the attention of the query that writes
the first answer token; on the passkey benchmark it trains a much worse predictor, see the README);
positive when ``p`` is among
the top ``label_top`` fraction of the context's positions by it (the heavy hitters the answer used).

Features. Key norms and per-KV-head attention are not in traces, so the trainer replays the prefill
of the first ``C`` token ids (teacher-forced, on the model named in the trace, which must be on the
machine) through the engine with a capture policy that computes :func:`slot_features`, the same
function the policy runs, so training and serving see the same inputs. The capture also yields the
prefill column sums, for the h2o-style baseline of the held-out metrics.

Held-out ranking quality. Requests are split (by a seeded shuffle) into training and held-out ones;
on every held-out request and layer, ``recall@keep`` is the share of the label's heavy hitters that
a policy keeping the top ``keep`` fraction of the context retains, for the predictor and for the
baselines ``tova`` (last-row attention averaged over the layer's heads), ``h2o`` (prefill column
sums per KV head, newest half of the budget protected, as ``h2o``'s defaults do) and ``recency``.
With no request held out (``holdout`` 0, or a single request) nothing is measured: the metrics are None,
never figures on the training requests.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from sparseety.errors import InputError
from sparseety.policies.base import Observation, Policy, Signal
from sparseety.policies.parts.learned_features import attention_share, feature_names, slot_features
from sparseety.policies.parts.learned_model import Predictor

KEEPS = (0.5, 0.25)


@dataclass
class TraceExample:
    """What one tier-3 request gives the trainer."""

    request_id: str
    model: str
    token_ids: list[int]
    context_len: int
    future: np.ndarray  #: ``[layers, C]`` attention each context position receives from later steps (by the label)
    recorded: list[int]  #: layers whose label is not all zero


LABELS = ("max", "sum", "question")
LABEL_WORDS = {"max": "the maximum", "sum": "summed", "question": "the question forward's row only"}


def read_examples(trace_dir: str | Path, model: str | None = None, label: str = "max") -> list[TraceExample]:
    """Every tier-3 request of the dataset (of ``model`` only, when given), oldest first, each position's
    later attention reduced by ``label`` (``max`` or ``sum`` over the later steps, or ``question``: step 1's row).

    Raises
    ------
    InputError
        No tier-3 request with later steps (or several models and no ``model`` chosen).
    """
    from sparseety.store import connect, load_trace

    if label not in LABELS:
        raise InputError(f"label must be one of {', '.join(LABELS)}, got {label!r}")
    root = check_trace_dir(trace_dir)
    con = connect(root)
    if model is not None:
        found = sorted(r[0] for r in con.sql("SELECT DISTINCT model FROM requests").fetchall())
        if model not in found:
            raise InputError(f"no traces of model {model!r} in {root} (--model); it holds traces of "
                             f"{', '.join(found) if found else 'no model'}")
    rows = con.sql("SELECT request_id, model FROM requests WHERE tier >= 3 ORDER BY created_at, request_id").fetchall()
    if model is not None:
        rows = [r for r in rows if r[1] == model]
    models = sorted({r[1] for r in rows})
    if len(models) > 1:
        raise InputError(f"{root} holds tier-3 traces of several models ({', '.join(models)}); choose one with --model")
    out: list[TraceExample] = []
    for request_id, name in rows:
        trace = load_trace(root, request_id)
        steps = trace.arrays.get("step_importance")
        if steps is None or steps.ndim != 3 or steps.shape[0] < 2:
            continue
        first = steps[0, 0]
        context_len = int(np.count_nonzero(~np.isnan(first)))
        later = np.nan_to_num(steps[1:, :, :context_len].astype(np.float32), nan=0.0)
        future = {"max": later.max(axis=0), "sum": later.sum(axis=0), "question": later[0]}[label]
        recorded = [layer for layer in range(future.shape[0]) if future[layer].sum() > 0]
        ids = list(trace.document["prompt_token_ids"]) + list(trace.document["output_token_ids"])
        if context_len < 8 or not recorded or len(ids) < context_len:
            continue
        out.append(TraceExample(request_id=request_id, model=name, token_ids=ids, context_len=context_len,
                                future=future, recorded=recorded))
    if not out:
        raise InputError(f"no tier-3 traces with decode steps in {root} (record some with `sparseety run "
                         f"--tier 3 --policy dense --trace-dir {root} ...`)")
    return out


def check_trace_dir(trace_dir: str | Path) -> Path:
    """``trace_dir`` as a path, refused unless it is an existing directory (a file is named as one)."""
    root = Path(trace_dir)
    if root.exists() and not root.is_dir():
        raise InputError(f"{root} is a file, expected a trace directory (one written by `sparseety run "
                         "--trace-dir DIR`)")
    if not root.is_dir():
        raise InputError(f"trace directory {root} does not exist")
    return root


@dataclass
class _Capture(Policy):
    """Scores nothing and evicts nothing (no budget): keeps each layer's features and attention at prefill."""

    name: ClassVar[str] = "learned-capture"
    prefill_signal: ClassVar[Signal] = Signal.WINDOW
    decode_signal: ClassVar[Signal] = Signal.NONE
    needs_token_ids: ClassVar[bool] = True
    rows: int = 1 << 20
    class_table: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int8))
    out: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def window_rows(self) -> int:
        return self.rows

    def score(self, obs: Observation) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert obs.attention is not None
        window = obs.attention.float()  # [1, kv_heads, C, C]: every prefill row
        last = window[:, :, -1]
        x = slot_features(obs.positions, obs.keys, last, attention_share(last), obs.token_ids, self.class_table,
                          obs.layer, obs.num_layers)
        # clones: a view would keep the whole [kv_heads, C, C] window of every layer alive
        self.out[obs.layer] = {"x": x[0].cpu().clone(), "last": last[0].cpu().clone(),
                               "colsum": window.sum(dim=2)[0].cpu().clone()}
        return torch.zeros_like(last), None


@dataclass
class Captured:
    """One request's replayed prefill: per layer ``x`` ``[kv_heads, C, F]``, ``last``/``colsum`` ``[kv_heads, C]``
    (slot order = position order at prefill)."""

    example: TraceExample
    layers: dict[int, dict[str, torch.Tensor]]


def capture(engine: Any, example: TraceExample, class_table: torch.Tensor) -> Captured:
    """Replay ``example``'s prefill (teacher-forced, dense) and keep its features per layer."""
    from sparseety.engine import EncodedInput

    ids = torch.tensor([example.token_ids[: example.context_len]], dtype=torch.long)
    policy = _Capture(class_table=class_table)
    with engine.open_run(EncodedInput(input_ids=ids), policy, tier=0) as ctx:
        engine.model(input_ids=ids, past_key_values=ctx.cache, use_cache=True)
    return Captured(example=example, layers=policy.out)


def heavy_hitters(future: np.ndarray, top: float) -> np.ndarray:
    """``[C]`` bool: the top ``top`` fraction of positions by ``future`` (ties: lower position), at least one."""
    k = max(1, int(round(top * future.shape[0])))
    order = np.lexsort((np.arange(future.shape[0]), -future))
    mask = np.zeros(future.shape[0], dtype=bool)
    mask[order[:k]] = True
    return mask


def kept_by(scores: np.ndarray, keep: float, protect_recent: int = 0) -> np.ndarray:
    """``[C]`` bool: the top ``keep`` fraction by ``scores`` (ties: lower position), the newest
    ``protect_recent`` positions first."""
    c = scores.shape[0]
    k = max(1, int(c * keep))
    s = scores.astype(np.float64).copy()
    if protect_recent:
        s[c - min(protect_recent, c):] = np.inf
    order = np.lexsort((np.arange(c), -s))
    mask = np.zeros(c, dtype=bool)
    mask[order[:k]] = True
    return mask


@dataclass
class TrainConfig:
    epochs: int = 30
    hidden: int = 16
    lr: float = 3e-3
    weight_decay: float = 1e-4
    label: str = "max"  #: how ``read_examples`` reduced the later steps (recorded in the provenance)
    label_top: float = 0.02
    holdout: float = 0.25
    max_examples: int = 300_000
    batch_size: int = 4096
    seed: int = 0


def split_requests(examples: Sequence[TraceExample], holdout: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of training and held-out requests (a seeded shuffle). ``holdout`` 0 holds none out; above 0, one
    at least is held out when there are two, and one at least is always trained on. With one request, or
    ``holdout`` 0, the held-out list is empty: no held-out figure can be measured."""
    order = list(range(len(examples)))
    random.Random(f"learn-policy:{seed}").shuffle(order)
    held = 0 if len(order) < 2 or holdout <= 0 else min(len(order) - 1, max(1, int(round(holdout * len(order)))))
    return sorted(order[held:]), sorted(order[:held])


def design(captured: Sequence[Captured], label_top: float, cap: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Training matrix ``[N, F]`` and labels ``[N]`` (every recorded layer and KV head; evenly subsampled to ``cap``)."""
    xs, ys = [], []
    for item in captured:
        for layer in item.example.recorded:
            label = torch.from_numpy(heavy_hitters(item.example.future[layer], label_top)).float()
            x = item.layers[layer]["x"]  # [kv, C, F]
            xs.append(x.reshape(-1, x.shape[-1]))
            ys.append(label.repeat(x.shape[0]))
    x_all, y_all = torch.cat(xs), torch.cat(ys)
    if x_all.shape[0] > cap:
        pick = torch.randperm(x_all.shape[0], generator=torch.Generator().manual_seed(seed))[:cap]
        x_all, y_all = x_all[pick], y_all[pick]
    return x_all, y_all


def fit(x: torch.Tensor, y: torch.Tensor, config: TrainConfig, on_epoch: Callable[[int, float], None] | None = None
        ) -> dict[str, torch.Tensor]:
    """Standardize, then fit the MLP (or logistic model, ``hidden=0``) with weighted BCE and Adam on the CPU."""
    gen = torch.Generator().manual_seed(config.seed)
    torch.manual_seed(config.seed)
    mean = x.mean(dim=0)
    std = x.std(dim=0, unbiased=False)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))
    z = (x - mean) / std
    f = x.shape[1]
    h = config.hidden
    if h:
        w1 = (torch.randn(f, h, generator=gen) / math.sqrt(f)).requires_grad_()
        b1 = torch.zeros(h, requires_grad=True)
        w2 = (torch.randn(h, generator=gen) / math.sqrt(h)).requires_grad_()
    else:
        w1 = torch.zeros(f, 0, requires_grad=True)
        b1 = torch.zeros(0, requires_grad=True)
        w2 = torch.zeros(f, requires_grad=True)
    b2 = torch.zeros(1, requires_grad=True)
    params = [p for p in (w1, b1, w2, b2) if p.numel()]
    opt = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    positives = float(y.sum())
    pos_weight = torch.tensor((y.numel() - positives) / max(positives, 1.0))
    loss_fn = torch.nn.BCEWithLogitsLoss(pos_weight=pos_weight)
    for epoch in range(config.epochs):
        order = torch.randperm(z.shape[0], generator=gen)
        total = 0.0
        for start in range(0, z.shape[0], config.batch_size):
            idx = order[start: start + config.batch_size]
            hidden = torch.relu(z[idx] @ w1 + b1) if h else z[idx]
            loss = loss_fn(hidden @ w2 + b2, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * idx.numel()
        if on_epoch is not None:
            on_epoch(epoch, total / z.shape[0])
    return {"mean": mean, "std": std, "w1": w1.detach(), "b1": b1.detach(), "w2": w2.detach(), "b2": b2.detach()}


def evaluate(captured: Sequence[Captured], predictor: Predictor | None, label_top: float,
             keeps: Sequence[float] = KEEPS) -> dict[str, dict[str, float]]:
    """``{method: {"recall@keep=K": mean}}`` over every held-out request and recorded layer (see the module doc)."""
    sums: dict[str, dict[str, list[float]]] = {}

    def add(method: str, keep: float, value: float) -> None:
        sums.setdefault(method, {}).setdefault(f"recall@keep={keep}", []).append(value)

    for item in captured:
        for layer in item.example.recorded:
            data = item.layers[layer]
            target = heavy_hitters(item.example.future[layer], label_top)
            hits = target.sum()
            c = target.shape[0]
            for keep in keeps:
                budget = max(1, int(c * keep))
                def recall(mask: np.ndarray) -> float:
                    return float((mask & target).sum() / hits)
                if predictor is not None:
                    scores = predictor(data["x"]).numpy()  # [kv, C]
                    add("learned", keep, recall(kept_by(scores.mean(axis=0), keep)))
                    add("learned_kv_head", keep, float(np.mean([recall(kept_by(s, keep)) for s in scores])))
                add("tova", keep, recall(kept_by(data["last"].numpy().mean(axis=0), keep)))
                add("h2o", keep, float(np.mean([recall(kept_by(s, keep, protect_recent=int(budget * 0.5)))
                                                for s in data["colsum"].numpy()])))
                add("recency", keep, recall(kept_by(np.arange(c, dtype=np.float64), keep)))
    return {m: {k: round(float(np.mean(v)), 4) for k, v in table.items()} for m, table in sums.items()}


#: the provenance's ``metrics_on`` when no request was held out (the metrics are then null)
NO_HELDOUT = "none: no request was held out (--holdout 0, or a single request), so no held-out figure was measured"


@dataclass
class LearnResult:
    predictor: Predictor
    metrics: dict[str, dict[str, float]] | None  #: held-out figures; None when no request was held out
    train_requests: list[str]
    heldout_requests: list[str]
    examples: int


def learn(engine: Any, examples: Sequence[TraceExample], config: TrainConfig, *, trace_dir: str, text_source: str,
          on_progress: Callable[[str], None] | None = None) -> LearnResult:
    """Replay, label, split, fit and evaluate; returns the predictor with its provenance filled in."""
    from sparseety.version import __version__
    from sparseety.fingerprint import config_summary, model_fingerprint
    from sparseety.policies.parts.learned_features import class_table_for

    say = on_progress or (lambda _m: None)
    info = engine.model_info
    table = class_table_for(engine.tokenizer, info.vocab_size or len(engine.tokenizer))
    captured = []
    for i, example in enumerate(examples):
        captured.append(capture(engine, example, table))
        say(f"replayed request {i + 1}/{len(examples)} ({example.context_len} tokens)")
    train_idx, held_idx = split_requests(examples, config.holdout, config.seed)
    x, y = design([captured[i] for i in train_idx], config.label_top, config.max_examples, config.seed)
    say(f"training on {x.shape[0]} slots ({int(y.sum())} positive) from {len(train_idx)} requests")
    weights = fit(x, y, config, on_epoch=lambda e, loss: say(f"epoch {e + 1}/{config.epochs}: loss {loss:.4f}"))
    features = feature_names(info.num_layers, info.kv_heads)
    predictor = Predictor(**weights, token_class=table, model=examples[0].model,
                          model_fingerprint=model_fingerprint(engine.model), features=features)
    # measured only on requests the fit never saw; with none held out there is no such figure
    metrics = evaluate([captured[i] for i in held_idx], predictor, config.label_top) if held_idx else None
    predictor.provenance = {
        "sparseety_version": __version__,
        "model": examples[0].model,
        "model_fingerprint": predictor.model_fingerprint,
        "model_config": config_summary(engine.model),
        "features": features,
        "label": f"top {config.label_top:g} of the context's positions by attention received from later steps "
                 f"(step_importance rows after the prefill, {LABEL_WORDS[config.label]}), per layer",
        "trace_dir": str(trace_dir),
        "text_source": text_source,
        "requests": len(examples),
        "train_request_ids": [examples[i].request_id for i in train_idx],
        "heldout_request_ids": [examples[i].request_id for i in held_idx],
        "training_slots": int(x.shape[0]),
        "config": dataclasses.asdict(config),
        "metrics": metrics,
        "metrics_on": "held-out requests" if held_idx else NO_HELDOUT,
    }
    return LearnResult(predictor=predictor, metrics=metrics,
                       train_requests=[examples[i].request_id for i in train_idx],
                       heldout_requests=[examples[i].request_id for i in held_idx], examples=int(x.shape[0]))
