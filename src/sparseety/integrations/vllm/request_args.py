"""One request's ``sparseety_*`` args (``vllm_xargs``), checked where vLLM validates a request: a bad one is the
client's error (HTTP 400 naming the arg, the value cut short and what is allowed), never a silent dense run.

Checked here: unknown ``sparseety_*`` keys (with the closest known one), ``sparseety_tier`` (3),
``sparseety_importance`` (a mode or ``off``), and the eviction args through the same
:meth:`.EvictionSettings.for_request` the engine core and the worker use, so the three agree. Eviction args on a
server that does not evict (no ``SPARSEETY_KV_POLICY``, or its hooks off) are refused too. What only the engine
core can know (a surrogate missing for the served checkpoint) still serves that request dense, counted and
recorded. No vLLM, no torch unless a request asks for eviction.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from sparseety.integrations.vllm.observe.attention_capture import MODE_ARG, MODES, TIER_ARG
from sparseety.integrations.vllm.evict.settings import EVICTION_ARGS, POLICY_ARG, EvictionSettings
from sparseety.integrations.vllm.transport.values import BadValue, clipped, is_blank, shown

PREFIX = "sparseety_"
REQUEST_ARGS = (*EVICTION_ARGS, TIER_ARG, MODE_ARG)  #: every ``sparseety_*`` key a request may send
_PROMPT_UNKNOWN = 1_000_000  #: a ratio's budget before the prompt is known (the engine core resolves it exactly)


def check_request_args(extra: Mapping[str, Any] | None, eviction: EvictionSettings | None) -> None:
    """Raise :class:`~.strict_values.BadValue` (``name``: the arg) for the first bad ``sparseety_*`` arg in
    ``extra`` on a server evicting with ``eviction`` (None: it does not evict)."""
    if not extra:
        return
    mine = {k: v for k, v in extra.items() if isinstance(k, str) and k.startswith(PREFIX)}
    for key in mine:
        if key not in REQUEST_ARGS:
            near = difflib.get_close_matches(key, REQUEST_ARGS, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
            raise BadValue(clipped(key), f"{shown(key)} is not a SparSEEty request arg{hint}; known: {', '.join(REQUEST_ARGS)}")
    tier = mine.get(TIER_ARG)
    if not is_blank(tier) and (isinstance(tier, bool) or str(tier).strip() != "3"):
        raise BadValue(TIER_ARG, f"{TIER_ARG}={shown(tier)} is not 3 (store this request at tier 3 whatever the "
                       "sampling)")
    mode = mine.get(MODE_ARG)
    if not is_blank(mode) and (not isinstance(mode, str) or mode.strip() not in (*MODES, "off")):
        raise BadValue(MODE_ARG, f"{MODE_ARG}={shown(mode)} is not one of {', '.join((*MODES, 'off'))}")
    asked = [k for k in EVICTION_ARGS if not is_blank(mine.get(k))]
    if not asked:
        return
    if eviction is None:
        if asked == [POLICY_ARG] and isinstance(mine[POLICY_ARG], str) and mine[POLICY_ARG].strip() == "dense":
            return  # dense on a server that does not evict: what it gets anyway
        raise BadValue(asked[0], f"{asked[0]}={shown(mine[asked[0]])}: this vLLM server does not evict (it was "
                       "started without SPARSEETY_KV_POLICY; SPARSEETY_KV_POLICY=dense lets requests choose)")
    eviction.for_request(mine, _PROMPT_UNKNOWN)
