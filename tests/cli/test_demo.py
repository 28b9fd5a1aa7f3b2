"""The README's run command: serve the tiny model, stream a generation, read its trace back."""

from __future__ import annotations

from switchyard.cli.main import main


def test_demo_serves_generates_and_traces(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert main(["demo", "--max-tokens", "12", "--png", str(png), "The quick brown fox"]) == 0
    out = capsys.readouterr().out
    assert "time to first token" in out and "inter-token ms" in out
    assert "output 12 tokens" in out and f"timeline: {png}" in out
    # Two TTFTs, each saying where it was measured.
    assert "as this client saw it" in out and "times in the engine" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
