"""Bounded SQL (issue 25, finding 5): the sandbox's memory limit, threads and statement timeout stop
runaway statements of ``query``, ``traces``, ``report`` and the server's trace endpoints, each with one
error naming the limit and the flag that raises it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from sparseety.cli import app
from sparseety.errors import ConfigError, QueryLimitError
from sparseety.store import connect, write_trace
from sparseety.store.sandbox import SqlLimits, watching
from sparseety.store.synthetic import synthetic_result

RECURSIVE = "WITH RECURSIVE t(n) AS (SELECT 1 UNION ALL SELECT n+1 FROM t) SELECT count(*) FROM t"
HUGE_COUNT = "SELECT count(*) FROM range(10000000000000)"
HUGE_LIST = "SELECT list(i) FROM range(1000000000) r(i)"
HUGE_RESULT = "SELECT * FROM range(1000000000)"
TIMEOUT = "error: query stopped after 1 s (the statement timeout; --sql-timeout raises it)"


def memory_error(size: str, what: str = "it needed") -> str:
    return f"error: query stopped: {what} more than {size} (the memory limit; --sql-memory-limit raises it)"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dataset")
    write_trace(synthetic_result(0), root)
    return root


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def assert_one_error(result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [expected], result.stderr


# The issue's three statements (and a result too large for Python), in a child process so its peak
# resident memory can be read: each stops with its limit's message and the process stays small.
CHILD = """
import json, sys
from typer.testing import CliRunner
from sparseety.cli import app
out = []
for sql, timeout, memory in json.loads(sys.argv[2]):
    r = CliRunner().invoke(app, ["query", sql, "--trace-dir", sys.argv[1], "--format", "csv",
                                 "--sql-timeout", timeout, "--sql-memory-limit", memory, "--sql-threads", "1"])
    out.append([r.exit_code, r.stderr])
hwm = [line for line in open("/proc/self/status") if line.startswith("VmHWM:")]
print(json.dumps({"results": out, "peak_kib": int(hwm[0].split()[1])}))
"""


@pytest.mark.slow
def test_issue_statements_stop_at_their_limit_and_memory_stays_bounded(root):
    cases = [(RECURSIVE, "1", "128MiB"), (HUGE_COUNT, "1", "128MiB"), (HUGE_LIST, "600", "128MiB"),
             (HUGE_RESULT, "600", "16MiB")]
    done = subprocess.run([sys.executable, "-c", CHILD, str(root), json.dumps(cases)], capture_output=True,
                          text=True, timeout=900, check=True)
    reply = json.loads(done.stdout.strip().splitlines()[-1])
    results = reply["results"]
    assert results == [[2, TIMEOUT + "\n"], [2, TIMEOUT + "\n"], [2, memory_error("128.0 MiB") + "\n"],
                       [2, memory_error("16.0 MiB", "its result needs") + "\n"]]
    # The child's own peak, VmHWM of its own address space: RUSAGE_CHILDREN is the largest of every child
    # this test process ever waited for, and Linux carries ru_maxrss across fork and exec, so both would
    # report this process's own size (gigabytes after a model load earlier in the suite).
    peak_bytes = reply["peak_kib"] * 1024  # /proc reports KiB
    assert peak_bytes < 2 * 2**30, peak_bytes


def test_limits_are_set_on_the_connection(root):
    result = cli("query", "SELECT current_setting('memory_limit') AS m, current_setting('threads') AS t, "
                 "current_setting('temp_directory') AS d", "--trace-dir", str(root), "--format", "json",
                 "--sql-memory-limit", "64MiB", "--sql-threads", "1")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"m": "64.0 MiB", "t": 1, "d": ""}]
    defaults = cli("query", "SELECT current_setting('memory_limit') AS m, current_setting('threads') AS t",
                   "--trace-dir", str(root), "--format", "json")
    assert json.loads(defaults.stdout) == [{"m": "1.0 GiB", "t": 2}]


def test_a_locked_connection_cannot_raise_its_limits(root):
    result = cli("query", "SELECT * FROM duckdb_settings() WHERE name = 'memory_limit'", "--trace-dir", str(root),
                 "--format", "json", "--sql-memory-limit", "64MiB")
    assert json.loads(result.stdout)[0]["value"] == "64.0 MiB"
    con = connect(root)
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET memory_limit = '8GiB'")


def test_a_sort_past_the_memory_limit_does_not_spill_to_disk(root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli("query", "SELECT * FROM range(100000000) ORDER BY random()", "--trace-dir", str(root),
                 "--format", "csv", "--sql-memory-limit", "32MiB", "--sql-timeout", "600")
    assert_one_error(result, memory_error("32.0 MiB"))
    assert list(tmp_path.iterdir()) == []  # no DuckDB temp directory (.tmp) was made


def test_a_query_under_its_limits_still_answers(root):
    result = cli("query", "SELECT count(*) AS n FROM range(100000)", "--trace-dir", str(root), "--format", "json",
                 "--sql-timeout", "60", "--sql-memory-limit", "64MiB", "--sql-threads", "1")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == [{"n": 100000}]


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--sql-timeout", "0", "error: --sql-timeout must be more than 0 and at most 86400 seconds, got 0.0"),
    ("--sql-timeout", "1e9", "error: --sql-timeout must be at most 86400.0, got 1000000000.0"),
    ("--sql-threads", "0", "error: --sql-threads must be at least 1, got 0"),
    ("--sql-memory-limit", "10KB", "error: --sql-memory-limit must be between 1 MiB and 1 PiB, got '10KB'"),
    # 0 and 1 state the same minimum, the one the check applies
    ("--sql-memory-limit", "0", "error: --sql-memory-limit must be between 1 MiB and 1 PiB, got '0'"),
    ("--sql-memory-limit", "1", "error: --sql-memory-limit must be between 1 MiB and 1 PiB, got '1'"),
    ("--sql-memory-limit", "lots", "error: --sql-memory-limit must be a size such as 512MiB, 2GiB or a number of "
                                   "bytes, got 'lots'"),
])
def test_bad_limits_are_one_error_line(root, flag, value, expected):
    assert_one_error(cli("query", "SELECT 1", "--trace-dir", str(root), flag, value), expected)


@pytest.mark.parametrize(("flag", "value", "expected"), [
    ("--sql-memory-limit", "0", "error: --sql-memory-limit must be between 1 MiB and 1 PiB, got '0'"),
    ("--sql-memory-limit", "1", "error: --sql-memory-limit must be between 1 MiB and 1 PiB, got '1'"),
    ("--max-body-bytes", "0", "error: --max-body-bytes must be greater than or equal to 256, got 0"),
])
def test_serve_refusals_name_its_flags_and_the_limit_checked(flag, value, expected):
    """Before the model loads: serve's flag (never ServeConfig's field name), with the minimum its check applies."""
    result = cli("serve", flag, value)
    assert result.exit_code == 2 and result.stderr.startswith(expected), result.stderr
    assert "ServeConfig" not in result.stderr and result.stderr.count("\n") == 1


def test_sql_limits_validate_each_field():
    with pytest.raises(ConfigError, match=r"^sql_threads must be an integer from 1 to 256, got 1000$"):
        SqlLimits(threads=1000)
    with pytest.raises(ConfigError, match=r"^sql_timeout must be more than 0 and at most 86400 seconds, got -1$"):
        SqlLimits(timeout=-1)
    with pytest.raises(ConfigError, match=r"^sql_memory_limit must be between 1 MiB and 1 PiB, got 1024$"):
        SqlLimits(memory_limit=1024)


def test_the_timeout_interrupts_connections_of_the_store(root):
    with pytest.raises(QueryLimitError, match=r"^query stopped after 1 s \(the statement timeout") as info:
        with watching(SqlLimits(timeout=1.0)):
            connect(root).execute(RECURSIVE).fetchall()
    assert info.value.limit == "timeout"


@pytest.mark.parametrize("args", [("traces", "list"), ("traces", "show", synthetic_result(0).request_id)],
                         ids=["list", "show"])
def test_traces_commands_take_the_limits(root, args):
    assert_one_error(cli(*args, "--trace-dir", str(root), "--sql-memory-limit", "1MiB"), memory_error("1.0 MiB"))
    assert cli(*args, "--trace-dir", str(root), "--sql-memory-limit", "256MiB").exit_code == 0


def test_report_takes_the_limits(root, tmp_path):
    out = tmp_path / "r.html"
    assert_one_error(cli("report", str(root), "-o", str(out), "--sql-memory-limit", "1MiB"), memory_error("1.0 MiB"))
    assert not out.exists()
    assert cli("report", str(root), "-o", str(out), "--sql-memory-limit", "256MiB").exit_code == 0
    assert out.exists()


def test_server_trace_endpoints_answer_503_past_their_limits(root, smollm_engine):
    import httpx2 as httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serve"))
    from serve_helpers import live_server

    request_id = synthetic_result(0).request_id
    auth = {"Authorization": "Bearer k"}
    with live_server(smollm_engine, trace_dir=root, api_key="k", sql_memory_limit="1MiB") as srv:
        for path in ("/v1/traces", f"/v1/traces/{request_id}"):
            response = httpx.get(srv.url + path, headers=auth, timeout=60)
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "trace_read_limit"
            assert error["message"] == ("query stopped: it needed more than 1.0 MiB (the memory limit; "
                                        "`sparseety serve --sql-memory-limit` raises it)")
    with live_server(smollm_engine, trace_dir=root, api_key="k") as srv:  # defaults: 512 MiB, 1 thread, 10 s
        assert httpx.get(f"{srv.url}/v1/traces/{request_id}", headers=auth, timeout=60).status_code == 200
