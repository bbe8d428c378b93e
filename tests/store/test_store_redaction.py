"""Privacy end to end on a real run: planted secrets appear nowhere in the dataset's bytes or values."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparseety.engine import encode_prompt
from sparseety.policies import build_policy
from sparseety.store import connect, load_trace, write_trace

SECRETS = {
    "[EMAIL]": "alice.smith@example.com",
    "[PHONE]": "+1 415-555-0132",
    "[IP]": "10.20.30.40",
    "[CARD]": "4111 1111 1111 1111",
    "[API_KEY]": "sk-live-abcdefghijklmnopqrstuvwx",
}
# Pieces that would betray a secret even when its tokens were stored apart.
FRAGMENTS = ["alice", "smith@", "example.com", "555-0132", "+1 415", "10.20", "30.40", "4111", "abcdefghijkl", "sk-live"]
PROMPT = (f"My email is {SECRETS['[EMAIL]']}, my phone is {SECRETS['[PHONE]']}, the server is {SECRETS['[IP]']}, "
          f"my card is {SECRETS['[CARD]']} and the key is {SECRETS['[API_KEY]']}. Say OK.")


@pytest.fixture(scope="module")
def secret_run(smollm_engine):
    encoded = encode_prompt(smollm_engine.tokenizer, PROMPT, True)
    return smollm_engine.generate(encoded, build_policy("h2o", 24), max_new_tokens=4, tier=3, top_k=64)


def strings_in(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [s for item in value for s in strings_in(item)]
    return []


def all_strings(con) -> str:
    """Every string value of every table, read back through DuckDB (decompressed, decoded)."""
    out = []
    for table in ("requests", "token_events", "important_tokens", "signals"):
        for row in con.sql(f"SELECT * FROM {table}").fetchall():
            out.extend(strings_in(list(row)))
    return "\n".join(out)


def test_redacted_secrets_reach_no_byte_and_no_value(secret_run, smollm_engine, tmp_path: Path):
    assert all(s in "".join(secret_run.token_texts) for s in SECRETS.values())  # the run did see them
    extra = {"compare": {"dense_text": f"write to {SECRETS['[EMAIL]']}", "n": 1}}
    write_trace(secret_run, tmp_path, extra=extra, redact=True, compression="none")
    raw = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    values = all_strings(connect(tmp_path))
    for piece in [*SECRETS.values(), *FRAGMENTS]:
        assert piece.encode() not in raw, piece
        assert piece not in values, piece
    trace = load_trace(tmp_path)
    joined = "".join(trace.document["token_texts"])
    for placeholder in SECRETS:
        assert placeholder in joined
    assert trace.document["compare"]["dense_text"] == "write to [EMAIL]"
    # The ids of redacted tokens are masked too: decoding the stored ids gives the secrets back nowhere.
    ids = trace.document["prompt_token_ids"] + trace.document["output_token_ids"]
    assert -1 in ids and len(ids) == len(secret_run.prompt_ids) + len(secret_run.output_ids)
    decoded = smollm_engine.tokenizer.decode([i for i in ids if i >= 0])
    assert not any(piece in decoded for piece in [*SECRETS.values(), "alice", "555-0132", "4111"])
    events = trace.arrays["evicted.token_id"][trace.arrays["evicted.token_id"] >= 0]
    assert set(events.tolist()) <= set(ids)
    # Non-secret text survives.
    assert "My email is" in joined and "Say OK" in joined


def test_ids_only_stores_no_text_at_all(secret_run, tmp_path: Path):
    write_trace(secret_run, tmp_path, ids_only=True, compression="none",
                extra={"compare": {"dense_text": "the word marmalade", "n": 2}})
    raw = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    for word in ("email", "server", "Say OK", "marmalade", *SECRETS.values()):
        assert word.encode() not in raw, word
    con = connect(tmp_path)
    assert con.sql("SELECT text, token_texts FROM requests").fetchall() == [(None, None)]
    assert con.sql("SELECT count(*) FROM important_tokens WHERE text IS NOT NULL").fetchall() == [(0,)]
    assert con.sql("SELECT count(*) FROM important_tokens").fetchall()[0][0] == len(secret_run.important_tokens)
    trace = load_trace(tmp_path)
    assert trace.document["prompt_token_ids"] == secret_run.prompt_ids  # ids-only keeps exact ids
    assert trace.document["compare"] == {"dense_text": None, "n": 2}
