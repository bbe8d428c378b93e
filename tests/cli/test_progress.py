"""Progress of long commands: one plain line per step off a terminal (with the count, rate and time
left), nothing when quiet, and a resumed run counts from where it stopped."""

from __future__ import annotations

from sparseety.cli.progress import steps


def test_plain_lines_off_a_terminal(capsys):
    with steps(3, "cases", done=1) as progress:
        progress.advance("first")
        progress.advance("second")
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" ", 1)[0] for line in lines] == ["[2/3]", "[3/3]"]
    assert lines[0].startswith("[2/3] cases: first (") and "s/step" in lines[0] and "left)" in lines[0]


def test_quiet_prints_nothing(capsys):
    with steps(3, "cases", quiet=True) as progress:
        progress.advance("x")
    assert capsys.readouterr().err == ""


def test_a_terminal_gets_a_rich_bar(capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with steps(2, "budgets") as progress:
        progress.advance("budget 4")
        progress.advance("budget 8")
    err = capsys.readouterr().err
    assert "budgets" in err and "2/2" in err and "/min" in err and "budget 8" in err
