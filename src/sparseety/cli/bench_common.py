"""What the long-document benchmark commands share (``bench passkey``, ``bench ruler``): checking the policy,
ratio and length flags before the model loads, reading back an unfinished run for ``--resume``, and
rewriting the result document after every finished answer while progress goes to stderr."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from sparseety.cli.bounds import MAX_LENGTH
from sparseety.cli.lists import parse_list
from sparseety.errors import ConfigError, InputError

R = TypeVar("R")


def check_policies(raw: str, options: dict[str, dict[str, str]] | None = None) -> list[str]:
    """The ``--policies`` names; an unknown name or option fails here, before the model loads."""
    from sparseety.policies import build_policy

    names = parse_list(raw, "--policies", str)
    for name in names:
        build_policy(name, 1 << 20, (options or {}).get(name, {}))
    return names


def policy_options_by_name(items: Sequence[str], names: Sequence[str]) -> dict[str, dict[str, str]]:
    """``--policy-opt`` values per policy: ``POLICY:KEY=VALUE`` sets one policy's option, ``KEY=VALUE``
    sets it on every policy of ``names`` (each must have that option)."""
    from sparseety.policies import parse_policy_opts

    out: dict[str, dict[str, str]] = {name: {} for name in names}
    for item in items:
        head, sep, rest = item.partition(":")
        if sep and "=" not in head:
            if head not in out:
                raise ConfigError(f"--policy-opt {item!r} names policy {head!r}, which is not in --policies")
            out[head].update(parse_policy_opts([rest]))
        else:
            for name in names:
                out[name].update(parse_policy_opts([item]))
    return out


def policy_file_inputs(options: dict[str, dict[str, str]]) -> dict[str, str]:
    """``{path: sha256}`` of the files the policies read (``model=FILE`` of ``learned`` and ``kvzap``), for the
    resume key: a file whose contents changed is never reused (see :mod:`sparseety.suites.resume`)."""
    from sparseety.suites.resume import input_contents

    return input_contents((f"--policy-opt {name}:model", Path(opts["model"])) for name, opts in options.items()
                          if opts.get("model"))


def parse_ratios(raw: str) -> list[float]:
    from sparseety.ratio import check_ratio

    return [check_ratio(r, "--ratios: a ratio") for r in parse_list(raw, "--ratios", float)]


def parse_lengths(raw: str) -> list[int]:
    return parse_list(raw, "--lengths", int, lambda n: 50 <= n <= MAX_LENGTH, f"50 to {MAX_LENGTH} tokens")


def finished_results(target: Path, kind: str, settings: dict[str, Any], row_type: Callable[..., R], *,
                     resume: bool) -> list[R]:
    """The results an unfinished run at ``target`` already has (``resume``), or none to start afresh.

    Refuses (see :func:`sparseety.suites.resume.previous_run`) other settings on ``--resume``, or an
    unfinished run at ``target`` without it.
    """
    from sparseety.suites.resume import previous_run

    before = previous_run(target, kind, settings, resume=resume)
    try:
        return [row_type(**row) for row in before["results"]] if before else []
    except (TypeError, KeyError) as exc:
        raise InputError(f"cannot resume from {target}: its results are not {kind} results ({exc})") from None


@contextmanager
def saving_each(target: Path, settings: dict[str, Any], *, total: int, what: str, finished: Sequence[R],
                document: Callable[[list[R]], dict[str, Any]], describe: Callable[[R], str],
                quiet: bool = False) -> Iterator[Callable[[R], None]]:
    """Yield the ``on_result`` callback of a run: it rewrites ``target`` (``"complete": false``) with every
    result so far and reports one progress step (``describe(row)``) on stderr."""
    from sparseety.suites.resume import write_document
    from sparseety.cli.progress import steps

    kept = list(finished)
    with steps(total, what, quiet=quiet, done=len(finished)) as progress:
        def keep(row: R) -> None:
            kept.append(row)
            write_document(target, {**document(kept), "complete": False, "run": settings})
            progress.advance(describe(row))

        yield keep


def write_complete(target: Path, document: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """Write the finished document (``"complete": true``) and return it."""
    from sparseety.suites.resume import write_document

    done = {**document, "complete": True, "run": settings}
    write_document(target, done)
    return done
