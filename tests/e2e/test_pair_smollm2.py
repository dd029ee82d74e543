"""`kvxfer pair --model smollm2` and `kvxfer serve --model smollm2` end to end: the real model in
both workers and the oracle, text prompts, completions printed as text; a model that cannot
load is one line and exit status 2, from either command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer import pair
from kvxfer.engine import TEXT_PROMPTS, smollm2_path
from kvxfer.testing.processes import assert_nothing_left


def test_pair_smollm2_text_prompts_token_identical(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvxfer.cli", "pair", "--model", "smollm2", "--requests", "3", "--max-new-tokens", "8",
         "--warmup", "0", "--blocks", "64", "--json", str(report_path), "--log-dir", str(tmp_path / "logs"),
         "--quiet"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(report_path.read_text())
    assert report["requests"] == report["matched"] == 3 and report["failed"] == 0
    assert report["config"]["model_config"]["layers"] == 30 and report["config"]["model_config"]["vocab_size"] == 49152
    assert [s["prompt"] for s in report["samples"]] == list(TEXT_PROMPTS[:3])
    assert report["samples"][0]["completion"].startswith(" Paris.")
    assert all(r["transfer"]["status"] == "delivered" and len(r["tokens"]) == 8 for r in report["results"])
    assert "  text         'The capital of France is' -> ' Paris." in proc.stdout
    assert_nothing_left(report["config"]["processes"])


def _one_line_exit_2(argv: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "kvxfer.cli", *argv], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def cut_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A GGUF whose header is sound and whose tensors' data is cut short: refused in one line
    naming the first tensor that runs past the end."""
    path = tmp_path_factory.mktemp("gguf") / "cut.gguf"
    path.write_bytes(smollm2_path().read_bytes()[: 4 << 20])
    return path


def test_serve_refuses_a_bad_model_in_one_line(cut_gguf: Path, tmp_path: Path) -> None:
    line = _one_line_exit_2(["serve", "--role", "prefill", "--model", "llama9"])
    assert line == "kvxfer serve: error: unknown model 'llama9': use toy, smollm2 or a path to a .gguf file"
    (tmp_path / "notes.gguf").write_text("notes")
    assert "notes.gguf is not a GGUF file" in _one_line_exit_2(["serve", "--role", "decode", "--model",
                                                                 str(tmp_path / "notes.gguf")])
    line = _one_line_exit_2(["serve", "--role", "decode", "--model", str(cut_gguf)])
    assert line.startswith("kvxfer serve: ") and "cut.gguf: tensor 'token_embd.weight' runs past the end" in line


def test_pair_refuses_a_bad_model_in_one_line(cut_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, words in ((["--model", "nope"], "kvxfer pair: error: unknown model 'nope'"),
                        (["--model", "smollm2", "--checkpoint", "x"], "both name weights: give one"),
                        (["--model", str(cut_gguf)], "cut.gguf: tensor 'token_embd.weight' runs past the end of the file"),
                        # The shape flags take the file's shape: SmolLM2 has 3 KV heads, not the toy's 2.
                        (["--model", "smollm2", "--prefill-tp", "2"], "--prefill-tp 2 must divide the model's 3 KV")):
        with pytest.raises(SystemExit) as exc:
            pair.main(argv)  # refused before any process starts
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err and "Traceback" not in err, err
