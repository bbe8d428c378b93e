"""Installing a hook's wrapper on a vLLM method (:func:`patch`, marked with :data:`.guards.MARK`, once per
process), and reading a wrapped call's arguments (:func:`arg`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from sparseety.integrations.vllm.vllm_api.guards import MARK


# -- patching ----------------------------------------------------------------------------------------------
def installed(owner: Any, attr: str, hook: str | None = None) -> bool:
    """Whether ``owner.attr`` is already one of SparSEEty's wrappers (vLLM may load a plugin twice); with
    ``hook``, whether that hook's wrapper is among the wrappers stacked there (two hooks may wrap one method)."""
    fn = inspect.getattr_static(owner, attr, None)
    if hook is None:
        return getattr(fn, MARK, None) is not None
    while fn is not None and getattr(fn, MARK, None) is not None:
        if getattr(fn, MARK) == hook:
            return True
        fn = getattr(fn, "__wrapped__", None)
    return False


def patch(owner: Any, attr: str, hook: str, make: Callable[[Callable], Callable]) -> bool:
    """Put ``make(original)`` in place of ``owner.attr`` (a wrapper that passes vLLM's call through to
    ``original`` unchanged), marked as ``hook``'s; False when it is there already (another hook's wrapper
    there is wrapped in turn)."""
    if installed(owner, attr, hook):
        return False
    original = inspect.getattr_static(owner, attr)
    wrapper = make(original)
    functools.update_wrapper(wrapper, original)
    setattr(wrapper, MARK, hook)
    setattr(owner, attr, wrapper)
    return True


def arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    """Parameter ``name`` (the ``index``-th after ``self``) of a call vLLM made."""
    return args[index] if len(args) > index else kwargs.get(name, default)
