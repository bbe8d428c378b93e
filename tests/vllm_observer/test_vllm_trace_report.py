"""A vLLM trace carries what an own-engine trace carries, and its report reads like one: one real
``vllm serve`` (side venv, loopback, prefix caching, KV events, ngram speculative decoding), one round of
traffic, then each test checks the stored trace against what vLLM's own API answered.

- Drafts with identities: every verify step's draft ids and positions, which were accepted; per request
  drafted = accepted + rejected = vLLM's own per-request counts; an accepted draft's id is the output token
  at its position.
- The report of a tier-2 vLLM trace: token texts (no privacy flag is set), the model's name rather than its
  cache directory, KV bytes from the blocks the request held (never "0.00 MiB"), prefix-cache tokens
  labelled as cached (not as skipped), rejected drafts marked by position; rendered in headless Chromium,
  with a screenshot in ``test-artifacts/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from vllm_server import BLOCK_SIZE, ROOT, VllmServer, require_vllm, wait_for_vllm_rows

from sparseety.store import connect, load_trace

pytestmark = pytest.mark.model

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
PREFIX = ("The GNU General Public License is a free, copyleft license for software and other kinds of "
          "works. It guarantees your freedom to share and change all versions of a program. ") * 6
#: prompts whose continuations repeat what the prompt says (ngram drafts get accepted) and ones that do
#: not (drafts get rejected)
PROMPTS = [PREFIX + "First question: what does it guarantee?",
           PREFIX + "Second question: who may change it?",
           "Count: one two three four, one two three four, one two three four, one two",
           "List the colours: red green blue, red green blue, red green blue, red green",
           "Write a short story about a lighthouse keeper and a storm at sea."]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    require_vllm()
    from sparseety.models.registry import resolve_model_dir

    base = tmp_path_factory.mktemp("vllm-report")
    srv = VllmServer(resolve_model_dir("smollm2-135m"), base / "traces", base / "vllm.log").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def traffic(server):
    """Every prompt once (the shared-prefix pair one after the other, so the second hits the prefix
    cache), the rest concurrently (several requests verify drafts in the same step)."""
    responses = [server.complete(PROMPTS[0], MAX_TOKENS)]
    with ThreadPoolExecutor(4) as pool:
        responses += list(pool.map(lambda p: server.complete(p, MAX_TOKENS), PROMPTS[1:]))

    wait_for_vllm_rows(server.trace_dir, len(responses))
    con = connect(server.trace_dir)
    rows = con.sql("SELECT request_id, prompt_token_ids, output_token_ids FROM requests WHERE policy = 'vllm'"
                   ).fetchall()
    ids = []
    for response in responses:
        choice = response["choices"][0]
        matches = [rid for rid, prompt, output in rows
                   if list(prompt) == choice["prompt_token_ids"] and list(output) == choice["token_ids"]]
        assert len(matches) == 1, (choice["prompt_token_ids"][:8], len(rows))
        ids.append(matches[0])
    return {"responses": responses, "ids": ids, "con": con}


def _drafts(con, request_id: str) -> list[tuple[str, int, int, int]]:
    return con.sql("SELECT event, step, position, token_id FROM token_events WHERE request_id = ? AND event IN "
                   "('draft_accepted', 'draft_rejected') ORDER BY seq", params=[request_id]).fetchall()


def test_drafts_have_ids_and_positions_that_add_up(server, traffic):
    con = traffic["con"]
    total = {"accepted": 0, "rejected": 0, "steps": 0}
    for request_id, response in zip(traffic["ids"], traffic["responses"], strict=True):
        choice = response["choices"][0]
        prompt, output = choice["prompt_token_ids"], choice["token_ids"]
        sequence = prompt + output
        rows = _drafts(con, request_id)
        info = json.loads(con.sql("SELECT extra_json FROM requests WHERE request_id = ?",
                                  params=[request_id]).fetchall()[0][0])["vllm"]
        spec = info["spec_decode"] or {"num_draft_tokens": 0, "num_accepted_tokens": 0}
        accepted = [r for r in rows if r[0] == "draft_accepted"]
        rejected = [r for r in rows if r[0] == "draft_rejected"]
        # drafted = accepted + rejected, and both equal vLLM's own per-request counts
        assert len(rows) == len(accepted) + len(rejected) == spec["num_draft_tokens"], request_id
        assert len(accepted) == spec["num_accepted_tokens"], request_id
        assert info["draft_ids_recorded"] is bool(rows)
        assert all(p >= 0 and t >= 0 for _, _, p, t in rows), "a draft without its position or id"
        # an accepted draft is the output token at its position; only the last verify step may run past the
        # end (vLLM accepted them, then cut the output at max_tokens or a stop)
        last_step = max((step for _, step, _, _ in rows), default=-1)
        for _, step, position, token in accepted:
            assert position >= len(prompt), (request_id, step, position)
            if position < len(sequence):
                assert sequence[position] == token, (request_id, step, position, token)
            else:
                assert step == last_step, (request_id, step, position, len(sequence))
        by_step: dict[int, list] = {}
        for row in rows:
            by_step.setdefault(row[1], []).append(row)
        for step, drafts in by_step.items():
            # a verify step's drafts follow its last token: positions prompt + step, + 1, ...
            assert [p for _, _, p, _ in drafts] == list(range(len(prompt) + step, len(prompt) + step + len(drafts)))
            events = [e for e, _, _, _ in drafts]
            n_ok = events.count("draft_accepted")
            assert events == ["draft_accepted"] * n_ok + ["draft_rejected"] * (len(drafts) - n_ok), (step, events)
            if n_ok < len(drafts):  # the first rejected draft is not the token the model produced there
                _, _, position, token = drafts[n_ok]
                if position < len(sequence):
                    assert sequence[position] != token, (request_id, step, position, token)
        total["accepted"] += len(accepted)
        total["rejected"] += len(rejected)
        total["steps"] += len(by_step)
    assert total["accepted"] > 0 and total["rejected"] > 0 and total["steps"] > 0, total


def _report(server, request_id: str, out: Path) -> str:
    cli = str(Path(sys.executable).with_name("sparseety"))
    subprocess.run([cli, "report", str(server.trace_dir), "--request-id", request_id, "-o", str(out)],
                   capture_output=True, text=True, check=True)
    return out.read_text()


def test_report_reads_like_an_own_engine_report(server, traffic, tmp_path):
    """Token texts, the model's name, KV bytes, cached tokens labelled, rejected drafts marked: in Chromium."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed")
    from playwright.sync_api import sync_playwright

    con = traffic["con"]
    cached_index = 1  # the second prompt shares the first one's prefix
    response = traffic["responses"][cached_index]
    cached = response["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 4 * BLOCK_SIZE
    # the request with the most rejected drafts shows their marks
    rejected_count = {rid: sum(e == "draft_rejected" for e, *_ in _drafts(con, rid)) for rid in traffic["ids"]}
    with_rejections = max(traffic["ids"], key=rejected_count.get)
    assert rejected_count[with_rejections] > 0

    model_dir = server.model
    trace = load_trace(server.trace_dir, traffic["ids"][cached_index])
    assert trace.document["model"] == Path(model_dir).name == "smollm2-135m"
    assert trace.document["provenance"]["model_path"] == model_dir
    texts = trace.document["token_texts"]
    sequence = response["choices"][0]["prompt_token_ids"] + response["choices"][0]["token_ids"]
    assert len(texts) == len(sequence) and "".join(texts[:20]).startswith("The GNU General Public License")
    sparsity = trace.document["sparsity"]
    blocks = json.loads(con.sql("SELECT extra_json FROM requests WHERE request_id = ?",
                                params=[traffic["ids"][cached_index]]).fetchall()[0][0])["vllm"]["kv_blocks_held"]
    # the blocks a request held cover its tokens (vLLM may reserve a block ahead for drafts)
    assert blocks >= -(-(len(sequence) - 1) // BLOCK_SIZE)
    assert sparsity["kv_cache_bytes_peak"] > 0 and sparsity["kv_cache_bytes_peak"] % blocks == 0
    assert sparsity["skipped_events"] is None

    ARTIFACTS.mkdir(exist_ok=True)
    pages = {"cached": (traffic["ids"][cached_index], tmp_path / "cached.html"),
             "drafts": (with_rejections, tmp_path / "drafts.html")}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        try:
            for name, (request_id, path) in pages.items():
                html = _report(server, request_id, path)
                # the page names the model by its name (its path stays in the provenance table)
                assert "<title>smollm2-135m · vllm · " in html and f"<td>{model_dir}</td>" in html
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                errors: list[str] = []
                page.on("pageerror", lambda e, errors=errors: errors.append(str(e)))
                page.goto(path.resolve().as_uri())
                page.wait_for_selector(".spx[data-ready]", timeout=15000)
                summary = page.locator('section[data-section="summary"]').inner_text()
                text = page.locator('section[data-section="text"]').inner_text()
                notes = page.locator(".spx").first.inner_text()
                assert "0.00 MiB" not in summary and "MiB" in summary, summary
                assert "skipped (top-k, window)" not in summary, summary
                assert "smollm2-135m" in summary and "/.cache/" not in summary, summary
                assert "Token texts were not stored" not in notes
                assert "⟨" not in text, text[:400]
                if name == "cached":
                    assert "General Public License" in text
                    assert "cached prompt tokens (prefix cache)" in summary and str(cached) in summary, summary
                    assert page.locator('section[data-section="text"] .text .mark-cached').count() == cached
                else:
                    rejected = {pos for e, _, pos, _ in _drafts(con, request_id) if e == "draft_rejected"}
                    n_positions = len(trace_sequence(con, request_id))
                    marked = page.locator('section[data-section="text"] .text .mark-rejected').count()
                    assert marked == len({p for p in rejected if p < n_positions}) > 0
                    first = min(p for p in rejected if p < n_positions)  # an output position: drawn in red
                    shadow = page.locator(f'section[data-section="text"] .text .tok[data-p="{first}"]').evaluate(
                        "e => getComputedStyle(e).boxShadow")
                    assert "rgb(215, 48, 31)" in shadow, shadow
                    assert page.locator('section[data-section="drafts"]').count() == 1
                page.screenshot(path=str(ARTIFACTS / f"vllm-report-{name}.png"), full_page=True)
                assert errors == []
                page.close()
        finally:
            browser.close()


def trace_sequence(con, request_id: str) -> list[int]:
    prompt, output = con.sql("SELECT prompt_token_ids, output_token_ids FROM requests WHERE request_id = ?",
                             params=[request_id]).fetchall()[0]
    return list(prompt) + list(output)
