"""The features the ``learned`` policy scores a slot by: what the engine knows about it at eviction time.

Training (``sparseety learn-policy``) and the policy compute them with this one function, so a trained
predictor sees at run time exactly the inputs it was trained on. Per slot of one layer and KV head,
with ``p`` the slot's position, ``N`` the newest position the head holds and ``n`` the slots it holds:

======================  ===========================================================================
``rel_position``        ``p / (N + 1)``
``log_position``        ``log(1 + p)`` (attention sinks sit at the first positions)
``log_recency``         ``log(1 + N - p)``
``key_norm_z``          the key's L2 norm, standardized over the head's slots (mean 0, std 1)
``log_attention_now``   ``log(n * a + 1e-3)``, ``a`` the newest query's attention (the last prompt row at
                        prefill, the decode row after), averaged over the KV group's query heads; a slot
                        that gets the uniform share ``1 / n`` scores ``log(1.001)``
``log_attention_max``   the same for the highest ``n * a`` the slot ever received (carried as the
                        policy's per-slot state; equal to ``log_attention_now`` at prefill)
``class=<c>``           one-hot token class (:data:`sparseety.token_classes.TOKEN_CLASSES`: special,
                        punctuation, digits, words, whitespace) from a per-vocabulary table stored with
                        the predictor; all zero for an unknown id
``layer=<l>``           one-hot layer
``kv_head=<h>``         one-hot KV head
======================  ===========================================================================
"""

from __future__ import annotations

import torch

from sparseety.token_classes import TOKEN_CLASSES, token_class

BASE_FEATURES = ("rel_position", "log_position", "log_recency", "key_norm_z", "log_attention_now",
                 "log_attention_max")
CLASS_FEATURES = tuple(f"class={c}" for c in TOKEN_CLASSES)
EPS = 1e-3


def feature_names(num_layers: int, kv_heads: int) -> list[str]:
    """Every feature, in the order of the last axis of :func:`slot_features`."""
    return [*BASE_FEATURES, *CLASS_FEATURES, *(f"layer={i}" for i in range(num_layers)),
            *(f"kv_head={h}" for h in range(kv_heads))]


def attention_share(attention: torch.Tensor) -> torch.Tensor:
    """``[b, kv_heads, n]``: attention times the slots held (1 = the uniform share)."""
    return attention.float() * attention.shape[-1]


def slot_features(positions: torch.Tensor, keys: torch.Tensor, attention: torch.Tensor, share_max: torch.Tensor,
                  token_ids: torch.Tensor | None, class_table: torch.Tensor, layer: int,
                  num_layers: int) -> torch.Tensor:
    """The feature matrix of one layer's slots.

    Parameters
    ----------
    positions : ``[b, kv_heads, n]`` original position of every slot.
    keys : ``[b, kv_heads, n, d]`` cached keys.
    attention : ``[b, kv_heads, n]`` the newest query's attention per slot (group-averaged).
    share_max : ``[b, kv_heads, n]`` the highest :func:`attention_share` each slot has received (this
        step included).
    token_ids : ``[b, kv_heads, n]`` token id per slot (-1 unknown), or None (every class unknown).
    class_table : ``[vocab]`` int index into :data:`TOKEN_CLASSES` per token id (-1 unknown).
    layer, num_layers : which layer, of how many.

    Returns
    -------
    ``[b, kv_heads, n, F]`` float32, in the order of :func:`feature_names`.
    """
    b, kv_heads, n = positions.shape
    pos = positions.float()
    newest = pos.amax(dim=-1, keepdim=True)
    norms = keys.float().norm(dim=-1)
    mean = norms.mean(dim=-1, keepdim=True)
    std = norms.std(dim=-1, unbiased=False, keepdim=True) if n > 1 else torch.zeros_like(mean)
    base = torch.stack([
        pos / (newest + 1),
        torch.log1p(pos),
        torch.log1p(newest - pos),
        (norms - mean) / (std + 1e-6),
        torch.log(attention_share(attention) + EPS),
        torch.log(share_max.float() + EPS),
    ], dim=-1)
    classes = torch.zeros(b, kv_heads, n, len(TOKEN_CLASSES), device=positions.device)
    if token_ids is not None:
        table = class_table.to(positions.device).long()
        ids = token_ids.long()
        valid = (ids >= 0) & (ids < table.shape[0])
        cls = torch.where(valid, table[ids.clamp(0, table.shape[0] - 1)], -1)
        known = cls >= 0
        classes.scatter_(-1, cls.clamp(min=0).unsqueeze(-1), known.unsqueeze(-1).float())
    layers = torch.zeros(b, kv_heads, n, num_layers, device=positions.device)
    layers[..., layer] = 1.0
    heads = torch.eye(kv_heads, device=positions.device).view(1, kv_heads, 1, kv_heads).expand(b, kv_heads, n, kv_heads)
    return torch.cat([base, classes, layers, heads], dim=-1)


def class_table_for(tokenizer: object, vocab_size: int) -> torch.Tensor:
    """``[vocab_size]`` int8 class index per token id, from the tokenizer's text of each id."""
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    known = min(vocab_size, len(tokenizer))  # type: ignore[arg-type]
    texts = tokenizer.batch_decode([[i] for i in range(known)])  # type: ignore[attr-defined]
    index = {c: i for i, c in enumerate(TOKEN_CLASSES)}
    table = [index[token_class(t, i in special)] for i, t in enumerate(texts)] + [-1] * (vocab_size - known)
    return torch.tensor(table, dtype=torch.int8)
