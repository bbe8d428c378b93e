"""Concurrent runs on one model: each thread's run sees only its own forwards, cache and probes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from tiny_models import prompt_ids, run

from sparseety.policies import build_policy


def _fingerprint(result):
    return (
        result.output_ids,
        result.eviction_events,
        {k: v.tolist() for k, v in sorted(result.arrays.items()) if not k.startswith("activation")},
        result.kept_positions_final,
    )


def test_concurrent_runs_equal_sequential_runs(engine_for):
    engine = engine_for("qwen2_moe")
    jobs = [("streaming", 12, 1), ("h2o", 10, 2), ("dense", None, 3), ("snapkv", 14, 4)] * 2
    def one(job):
        name, budget, seed = job
        return run(engine, prompt_ids(28, seed=seed), build_policy(name, budget), 6, tier=2)
    sequential = [_fingerprint(one(job)) for job in jobs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        concurrent = [_fingerprint(r) for r in pool.map(one, jobs)]
    assert concurrent == sequential


def test_router_probes_record_only_their_own_run(engine_for):
    engine = engine_for("qwen2_moe")
    def one(n):
        return run(engine, prompt_ids(n, seed=n), build_policy("dense", None), 4, tier=2)
    with ThreadPoolExecutor(max_workers=2) as pool:
        short, long = pool.map(one, (10, 30))
    # Router rows: one per token fed (prompt, then each generated token but the last).
    assert short.arrays["router.0"].shape[0] == 10 + 4 - 1
    assert long.arrays["router.0"].shape[0] == 30 + 4 - 1
    assert np.isfinite(long.arrays["router.0"].astype(np.float32)).all()
