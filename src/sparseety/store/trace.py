"""The contract every reader of a stored run relies on: :class:`StoredTrace`, :func:`write_trace`, :func:`load_trace`.

Report, bias analysis, replay and the server read runs only through these names, so the storage
layout behind them (the Parquet dataset of :mod:`sparseety.store.dataset`) can change without
touching them.

``StoredTrace.document`` is the ``sparseety run --json`` object plus ``prompt_token_ids``,
``token_texts`` (text per position, empty when ids-only), ``provenance`` and any ``extra`` sections a
command attached (``compare`` attaches ``{"compare": {...}}``). ``StoredTrace.arrays`` holds the
columnar arrays of :attr:`RunResult.arrays`: ``evicted.{step,layer,kv_head,position,token_id,score}``,
``attended.*``, ``skipped.*``, ``pruned.*``, ``drafted.{step,position,token_id,rejected}``,
``importance`` ``[layers, positions]``, ``router.<layer>`` ``[tokens, experts]``,
``activation.maxabs`` / ``activation.zero_frac`` ``[layers, tokens]``, ``step_importance``
``[steps, layers, positions]`` (tier 3).
"""

from __future__ import annotations

from sparseety.store.reader import StoredTrace, load_trace
from sparseety.store.writer import write_trace

__all__ = ["StoredTrace", "load_trace", "write_trace"]
