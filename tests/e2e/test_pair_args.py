"""`kvxfer pair` refuses a workload that cannot run, before it starts any process."""

from __future__ import annotations

import pytest

from kvxfer import pair


@pytest.mark.parametrize(("argv", "words"), [
    (["--concurrency", "0"], "--concurrency must be at least 1"),  # used to hang on Semaphore(0)
    (["--requests", "0"], "--requests must be at least 1"),        # used to report success on nothing
    (["--prefill-workers", "0"], "--prefill-workers must be at least 1"),
    (["--min-len", "300", "--max-len", "10"], "--min-len 300 is over --max-len 10"),
    (["--max-new-tokens", "5000"], "do not fit"),
    (["--timeout", "0"], "--timeout must be positive"),
])
def test_bad_workload_is_a_usage_error(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        pair.main([*argv, "--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
                   "--intermediate", "64", "--vocab", "64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
