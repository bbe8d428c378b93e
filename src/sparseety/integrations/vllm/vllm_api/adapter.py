"""One name for everything that touches vLLM's objects (``adapter.X``): the declarations and checks (:mod:`.needs`), the
patching (:mod:`.patching`) and the readers of each process (:mod:`.frontend`, :mod:`.scheduler`, :mod:`.worker`,
:mod:`.eviction`), gathered here so a hook reads vLLM only through them.

Every method SparSEEty wraps and every attribute it reads at run time is a :class:`Need` of one hook in
:data:`NEEDS`. :func:`check` looks each one up on vLLM's real classes when the plugin loads (a method: it
exists, with the parameters the hook was written for; an attribute: the class has it as a class attribute,
property, dataclass / msgspec / pydantic field, slot or annotation, or one of its methods assigns
``self.<name>``, read from the class's source), and turns a hook whose need is missing off with one
warning naming the hook and the missing name; the other hooks stay on and vLLM serves on. The attention
backend's class is known only at the first forward; its needs (:data:`IMPL_NEEDS`) are checked then
(:func:`check_class`). ``docs/vllm-internals.md``'s table is :func:`internals_table` (a test keeps them equal).

The readers below turn vLLM's objects into SparSEEty's own types (:mod:`.messages`, plain lists for what
goes over a channel); the rest of the integration never reads a vLLM object. :func:`patch` installs a
wrapper (marked with :data:`.hooks.MARK`). This module imports neither vLLM nor torch at import time.

A new hook (a sliding-window free in the hybrid KV cache manager's ``SingleTypeKVCacheManager``, the MoE
router's ``set_capture_fn``, a KV-cache spec from the spec registry, a scheduler class) is: its name and
what is lost without it in :data:`HOOKS`, its methods and attributes as :class:`Need` s in :data:`NEEDS`
(or checked with :func:`check_class` when its class is found at run time), a reader here that returns
SparSEEty's own type, and its :func:`patch` where the plugin installs hooks. The never-down test and the
internals page then cover it without further work.
"""

from sparseety.integrations.vllm.vllm_api.eviction import *  # noqa: F403
from sparseety.integrations.vllm.vllm_api.frontend import *  # noqa: F403
from sparseety.integrations.vllm.vllm_api.needs import *  # noqa: F403
from sparseety.integrations.vllm.vllm_api.patching import *  # noqa: F403
from sparseety.integrations.vllm.vllm_api.scheduler import *  # noqa: F403
from sparseety.integrations.vllm.vllm_api.worker import *  # noqa: F403
