"""benchmarks/result_file.py: the commit, the provenance keys every result file starts with, the writing."""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import sys

import pytest
from helpers import scripts

result_file = scripts.load("result_file")


def test_the_commit_is_the_environments_where_it_is_set(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_COMMIT", "abc1234")
    assert result_file.source_commit() == "abc1234"


@pytest.mark.skipif(shutil.which("git") is None, reason="no git")
def test_without_the_variable_the_commit_is_gits_short_head(monkeypatch, tmp_path):
    monkeypatch.delenv("SWITCHYARD_COMMIT", raising=False)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q", str(tmp_path)], check=True)
    subprocess.run([*git, "commit", "-q", "--allow-empty", "-m", "one"], cwd=tmp_path, check=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()
    monkeypatch.setattr(result_file, "ROOT", tmp_path)
    assert len(head) >= 7 and result_file.source_commit() == head


def test_without_git_or_a_repository_the_commit_is_empty(monkeypatch, tmp_path):
    monkeypatch.delenv("SWITCHYARD_COMMIT", raising=False)
    monkeypatch.setattr(result_file, "ROOT", tmp_path)  # no repository here
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert result_file.source_commit() == ""
    monkeypatch.setenv("PATH", str(tmp_path))  # no git on the path at all
    assert result_file.source_commit() == ""


def test_provenance_keys_in_order(monkeypatch):
    monkeypatch.setenv("SWITCHYARD_COMMIT", "feedbee")
    before = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    got = result_file.provenance("2x NVIDIA H200", ["--tp", "2", "--out", "a b.json"],
                                 script=scripts.BENCHMARKS / "decode.py")
    assert list(got) == ["command", "device", "date", "commit"]
    # the script relative to the repository root, the arguments quoted where the shell needs it
    assert got["command"] == "python benchmarks/decode.py --tp 2 --out 'a b.json'"
    assert got["device"] == "2x NVIDIA H200" and got["commit"] == "feedbee"
    date = datetime.datetime.fromisoformat(got["date"])
    assert date.utcoffset() == datetime.timedelta(0) and before <= date <= datetime.datetime.now(datetime.UTC)


def test_the_command_defaults_to_this_process_arguments(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", [str(scripts.BENCHMARKS / "load.py"), "--cpu", "--rates", "2"])
    assert result_file.command_line() == "python benchmarks/load.py --cpu --rates 2"
    elsewhere = tmp_path / "x.py"  # outside the repository: its full path
    assert result_file.command_line(["--a"], elsewhere) == f"python {elsewhere.resolve()} --a"


@pytest.mark.parametrize("indent", [1, 2])
def test_write_makes_the_folders_and_ends_with_a_newline(tmp_path, indent):
    path = tmp_path / "new" / "deeper" / "result.json"
    result = {"command": "python benchmarks/x.py", "rows": [{"b": 1, "a": 2.5}]}
    result_file.write_result(path, result, indent=indent)
    text = path.read_text()
    assert text == json.dumps(result, indent=indent) + "\n" and text.endswith("}\n")
    assert json.loads(text) == result and list(json.loads(text)["rows"][0]) == ["b", "a"]
    result_file.write_result(str(path), {"rows": []})  # a str path, an existing file: replaced
    assert path.read_text() == '{\n  "rows": []\n}\n'
