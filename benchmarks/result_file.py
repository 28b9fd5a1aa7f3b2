"""A benchmark's result file: the provenance it starts with (command, device, date, commit) and its writing.

The scripts are run as files (``python benchmarks/X.py``; with PYTHONSAFEPATH=1, as the Makefile and
the tests run them, benchmarks/ is not on sys.path), so they load this one by its path, as they load
their other siblings::

    result_file = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("result_file.py"))))
    result = {**result_file.provenance(device, argv, script=__file__), "rows": rows}
    result_file.write_result(out, result)
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def source_commit() -> str:
    """The commit of the code measured: $SWITCHYARD_COMMIT where it is set (a copy of a working tree on
    a benchmark machine, whose .git may be another commit's), else git's short HEAD; "" without git."""
    if os.environ.get("SWITCHYARD_COMMIT"):
        return os.environ["SWITCHYARD_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=False)
    except OSError:  # no git on the machine
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def command_line(argv: list[str] | None = None, script: str | Path | None = None) -> str:
    """``python benchmarks/X.py ARGS``: the command that reruns this one from the repository root.

    ``script`` is the caller's ``__file__`` (by default ``sys.argv[0]``, which is not the script's when
    a test calls its ``main(argv)``); ``argv`` its arguments (by default ``sys.argv[1:]``)."""
    path = Path(sys.argv[0] if script is None else script).resolve()
    # Relative to the root wherever it was started from, so that files of different runs compare.
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return shlex.join(["python", str(shown), *(sys.argv[1:] if argv is None else argv)])


def provenance(device: str, argv: list[str] | None = None, script: str | Path | None = None) -> dict[str, str]:
    """The keys every result file starts with: ``command`` (see ``command_line``), ``device`` as given,
    ``date`` (now, UTC, ISO 8601 to the second) and ``commit`` (``source_commit()``)."""
    return {"command": command_line(argv, script), "device": device,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": source_commit()}


def write_result(path: str | Path, result: dict[str, Any], indent: int = 2) -> None:
    """``result`` as JSON at ``path`` (its folders made where missing), with a trailing newline."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=indent) + "\n")


def finish_checked(result: dict[str, Any], out: str | Path | None, ok: bool, failure: str = "CHECKS FAILED") -> int:
    """The end of a benchmark whose measurements carry checks: ``checks_passed`` recorded, the file
    written where asked, one line saying whether every check passed (``failure`` where not), and the
    exit code (1 when a check failed)."""
    result["checks_passed"] = bool(ok)
    if out:
        write_result(out, result)
    print("all checks passed" if ok else failure, flush=True)
    return 0 if ok else 1
