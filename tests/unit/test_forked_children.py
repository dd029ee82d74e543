"""Served children forked from the fork server (kvxfer/worker/forked.py) behave as the fresh
interpreters they replace: exit status, stderr in the log, the caller's environment and
directory, a kill's -9, and a caller's unguarded script is not run again in the child."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvxfer.serving.keys import API_KEY_ENV
from kvxfer.worker.procs import Child, ProcessFailed


def test_a_refused_command_exits_2_with_its_one_line_error_in_the_log(tmp_path: Path) -> None:
    child = Child("router", ["router", "--port", "0"], tmp_path / "router.log")
    with pytest.raises(ProcessFailed, match="exited with 2 before it was ready"):
        child.wait_ready(60)
    assert child.stop() == 2
    lines = (tmp_path / "router.log").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvxfer router: error:"), lines


def test_the_child_takes_the_callers_environment_and_directory(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    # A port file named relative to the directory, and an API key only the environment gives.
    child = Child("router", ["router", "--port", "0", "--prefill", "http://127.0.0.1:9", "--decode",
                             "http://127.0.0.1:10", "--port-file", "ready.json"], tmp_path / "router.log",
                  env={**os.environ, API_KEY_ENV: "sesame-sesame-sesame"})
    try:
        info = child.wait_ready(60)
        assert json.loads((tmp_path / "ready.json").read_text())["port"] == info["port"]
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"{info['url']}/v1/models", timeout=30)
        assert refused.value.code == 401
        asked = urllib.request.Request(f"{info['url']}/v1/models",
                                       headers={"Authorization": "Bearer sesame-sesame-sesame"})
        with urllib.request.urlopen(asked, timeout=30) as answer:
            assert answer.status == 200
    finally:
        assert child.stop() == 0


def test_a_killed_child_reports_minus_9(tmp_path: Path) -> None:
    child = Child("router", ["router", "--port", "0", "--prefill", "http://127.0.0.1:9", "--decode",
                             "http://127.0.0.1:10"], tmp_path / "router.log")
    child.wait_ready(60)
    child.kill()
    assert child.stop() == -9


def test_an_unguarded_script_is_not_run_again_in_the_child(tmp_path: Path) -> None:
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(f"""
        from pathlib import Path
        from kvxfer.worker.procs import Child
        print("script ran", flush=True)
        child = Child("router", ["router", "--port", "0"], Path({str(tmp_path / "r.log")!r}))
        print("exit", child.stop(), flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["script ran", "exit 2"], done.stdout + done.stderr


def test_a_fork_server_forked_from_the_caller_serves_children_and_ends_with_the_block(tmp_path: Path) -> None:
    """``fork_server_here`` (what ``kvxfer pair`` does once torch is imported): refused while
    another thread runs; then the server is a fork of the caller holding no descriptor of the
    caller's but the standard three, a child forked from it runs and reports its exit status,
    a nested block is refused, and the server is reaped when the block ends, the caller still
    running (a script, a test calling ``pair.main``), leaving no server for the next child to use."""
    script = tmp_path / "here.py"
    script.write_text(textwrap.dedent(f"""
        import os, threading
        from pathlib import Path
        from multiprocessing import forkserver
        from kvxfer.worker.forked import fork_server_here
        from kvxfer.worker.procs import Child
        log = Path({str(tmp_path / "r.log")!r})
        stop = threading.Event()
        other = threading.Thread(target=stop.wait)
        other.start()
        with fork_server_here() as here:
            print("with a thread", here)
        stop.set()
        other.join()
        kept = os.readlink(f"/proc/self/fd/{{os.pipe()[0]}}")  # a descriptor of the caller's, not the server's
        with fork_server_here() as here:
            with fork_server_here() as nested:
                print("alone", here, "nested", nested)
            server = forkserver._forkserver._forkserver_pid
            print("server", server, Path(f"/proc/{{server}}/cmdline").read_bytes() == Path("/proc/self/cmdline").read_bytes())
            child = Child("router", ["router", "--port", "0"], log)
            # Once a child is forked, the server is past its start: only its own descriptors left.
            print("kept", [fd for fd in os.listdir(f"/proc/{{server}}/fd") if os.readlink(f"/proc/{{server}}/fd/{{fd}}") == kept])
            print("exit", child.stop(), flush=True)
        print("after the block", os.path.exists(f"/proc/{{server}}"), flush=True)
        print("next child's server", forkserver._forkserver._forkserver_pid)  # None: a fresh one, started then
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["with a thread False", "alone True nested False"], done.stdout + done.stderr
    assert lines[2].endswith(" True") and lines[3:] == ["kept []", "exit 2", "after the block False", "next child's server None"], \
        done.stdout + done.stderr
