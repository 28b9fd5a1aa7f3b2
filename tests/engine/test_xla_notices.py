"""The warm-up's stderr filter: XLA's delay-kernel notices dropped and counted, every other line
passed on unchanged and in order, stderr itself again afterwards."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from switchyard.service.engine.compile_cache import WarmUp
from switchyard.service.engine.xla_notices import NOTICE, NoticeFilter

XLA_LINE = (b"W1128 16:58:06.163112     631 cuda_timer.cc:88] Delay kernel timed out: measured time has "
            b"sub-optimal accuracy. There may be a missing warmup execution, please investigate in Nsight Systems.")


@pytest.mark.parametrize("piece", [1, 7, 64, 10_000])
def test_lines_split_anywhere_come_out_whole_without_the_notices(piece: int) -> None:
    log = b"".join([b"first line\n", XLA_LINE, b"\n", b"W1128 a real warning\n", XLA_LINE, b"\n", b"no newline"])
    notices = NoticeFilter()
    out = b"".join(notices.feed(log[i:i + piece]) for i in range(0, len(log), piece)) + notices.close()
    assert out == b"first line\nW1128 a real warning\nno newline"
    assert notices.dropped == 2


def test_a_last_line_without_newline_is_a_notice_too() -> None:
    notices = NoticeFilter()
    assert notices.feed(b"kept\n" + XLA_LINE) == b"kept\n"
    assert notices.close() == b"" and notices.dropped == 1
    assert NOTICE in XLA_LINE


def test_the_process_stderr_is_filtered_inside_and_itself_after() -> None:
    # In a process of its own: the filter takes over file descriptor 2, as XLA's C++ log writes to it.
    script = textwrap.dedent(f"""
        import os, sys
        from switchyard.service.engine.xla_notices import autotuner_notices_counted
        print("before", file=sys.stderr)
        with autotuner_notices_counted() as notices:
            os.write(2, {XLA_LINE!r} + b"\\n")
            print("python inside", file=sys.stderr)
            os.write(2, b"c++ inside\\n" + {XLA_LINE!r} + b"\\npartial ")
            os.write(2, b"line\\n")
        print("after", file=sys.stderr)
        os.write(2, {XLA_LINE!r} + b"\\n")
        print(notices.dropped)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == b"2"
    assert done.stderr == b"before\npython inside\nc++ inside\npartial line\nafter\n" + XLA_LINE + b"\n"


def test_a_process_without_stderr_compiles_as_before() -> None:
    script = textwrap.dedent("""
        import os, sys
        from switchyard.service.engine.xla_notices import autotuner_notices_counted
        os.close(2)
        sys.stderr = None
        with autotuner_notices_counted() as notices:
            pass
        print("done", notices.dropped)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == b"done 0", done


def test_the_warm_up_line_says_what_was_counted() -> None:
    assert "Delay kernel" not in WarmUp(3.0, 12).describe()
    text = WarmUp(3.0, 12, autotuner_notices=4).describe()
    assert "timed 4 candidates" in text and "'Delay kernel timed out' lines, not shown" in text
