"""Hosts in network namespaces, for multi-host tests on one machine (root only).

``with Hosts(["prefill", "decode"]) as hosts:`` makes a namespace per host and one for a
bridge, joined by a veth pair per host on a private subnet (10.213.0.0/24: host i is
10.213.0.(i+1), its device ``eth0``). The subnet exists only inside the namespaces: the
root namespace gets no device, address or route, so parallel runs cannot clash. Each
namespace has its loopback up; nothing else is configured.

Processes run in a host's namespace through ``ip netns exec`` (``command``, ``run``,
``popen``, ``python``; ``peer``: a ``SubprocessPeer`` child; ``serve``: ``kvxfer serve`` or
``kvxfer router``; ``http``: a request from that host), which also mounts a /sys of that
namespace: UCX lists network devices from /sys/class/net. Two processes in different namespaces still share one
kernel, so UCX moves their bytes over shared memory (``cma``, ``sysv``) unless told
otherwise: ``env(host)`` sets ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=eth0``, and
``counters(host)`` reads the host's veth byte counters, to check that the bytes crossed.

Faults, per host: ``cut`` / ``restore`` take its link down and up at the bridge (a cable
pulled: the host's own device stays configured, without carrier); ``loss(host, percent)``
drops that share of the packets arriving at the host (nftables ``numgen random``: this
kernel has no netem); ``blackhole`` drops every packet in and out, silently (no RST, no
ICMP); ``corrupt(host, per_mille)`` overwrites 4 bytes inside that share of the large TCP
packets arriving at the host (nftables payload mangling: on a veth nothing checks the TCP
checksum, so the damage reaches the receiver as data, silently); ``clear`` removes the nftables rules. The rules live in the host's namespace, so
they go with it.

Namespaces are named ``kvxns-<pid>-<n>-<host>`` (the bridge's ``-br``); ``close()`` ends the
processes started through ``popen`` and removes every namespace, on errors too; making
``Hosts`` first removes namespaces of this prefix whose process is gone (a run that was
killed). ``namespaces_available()`` says why namespaces cannot be made here, or None.
"""

from __future__ import annotations

import itertools
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from kvxfer.contract import KvxferError
from kvxfer.worker.procs import end_process

PREFIX = "kvxns-"
SUBNET = "10.213.0"  # /24; only inside the namespaces
DEVICE = "eth0"  # each host's veth end, in its own namespace
BRIDGE = "br0"
NFT_TABLE = "kvxfer_fault"
_IP_TIMEOUT_S = 20.0
_counter = itertools.count()


class NetnsError(KvxferError, RuntimeError):
    """An ``ip`` or ``nft`` command failed; the message has its output."""


def _run(argv: Sequence[str], *, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def namespaces_available() -> str | None:
    """None when this process can make network namespaces, veths, bridges and nftables
    rules; otherwise why not (tests skip with it)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"the {tool!r} command is not installed (iproute2, nftables)"
    probe = f"{PREFIX}{os.getpid()}-probe{next(_counter)}"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"cannot make a network namespace: {made.stderr.strip()}"
        checks = (
            (["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"], "a veth pair"),
            (["ip", "-n", probe, "link", "add", "b0", "type", "bridge"], "a bridge"),
            (["ip", "netns", "exec", probe, "nft", "add", "table", "inet", NFT_TABLE], "an nftables table"),
        )
        for argv, what in checks:
            done = _run(argv, check=False)
            if done.returncode != 0:
                return f"cannot make {what} in a namespace: {(done.stderr or done.stdout).strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot make a network namespace: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _pid_of(name: str) -> int | None:
    """The pid in a name of ours (``kvxns-<pid>-...``), or None."""
    if not name.startswith(PREFIX):
        return None
    head = name[len(PREFIX):].split("-", 1)[0]
    return int(head) if head.isdigit() else None


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def list_namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove namespaces of this prefix whose making process is gone; their names."""
    removed = []
    for name in list_namespaces():
        pid = _pid_of(name)
        if pid is not None and pid != os.getpid() and not _alive(pid):
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


@dataclass(frozen=True)
class Host:
    """One host: its namespace, address on the subnet, and veth (``device`` inside it, ``port``
    at the bridge)."""

    name: str
    ns: str  # the namespace
    ip: str
    port: str  # its veth end in the bridge's namespace
    device: str = DEVICE

    def url(self, port: int) -> str:
        return f"http://{self.ip}:{port}"


class Hosts:
    """Namespaces joined by a bridge; see the module's docstring."""

    def __init__(self, names: Sequence[str], *, subnet: str = SUBNET) -> None:
        if not names or len(set(names)) != len(names) or len(names) > 250:
            raise ValueError(f"host names must be 1 to 250 distinct names, got {list(names)!r}")
        tag = f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.bridge_ns = f"{tag}-br"
        self.hosts = {name: Host(name, f"{tag}-{name}", f"{subnet}.{i + 1}", f"h{i}") for i, name in enumerate(names)}
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._peers: list[Any] = []

    # --- lifetime ---------------------------------------------------------------------
    def __enter__(self) -> Hosts:
        self.open()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def open(self) -> None:
        sweep_stale()
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _run(["ip", "-n", br, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", br, "link", "set", BRIDGE, "up"])
        for host in self.hosts.values():
            self._add_ns(host.ns)
            # Made in the bridge's namespace with its other end straight in the host's: no
            # device ever exists in the root namespace.
            _run(["ip", "-n", br, "link", "add", host.port, "type", "veth", "peer", "name", host.device,
                  "netns", host.ns])
            _run(["ip", "-n", br, "link", "set", host.port, "master", BRIDGE])
            _run(["ip", "-n", br, "link", "set", host.port, "up"])
            _run(["ip", "-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", host.device])
            _run(["ip", "-n", host.ns, "link", "set", host.device, "up"])
        # The bridge forwards once its ports leave the learning states (no STP: at once).
        for host in self.hosts.values():
            self._wait_up(host)

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._made.append(name)
        _run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _wait_up(self, host: Host, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = _run(["ip", "-n", host.ns, "-j", "link", "show", "dev", host.device]).stdout
            if json.loads(state)[0].get("operstate") == "UP":
                return
            time.sleep(0.05)
        raise NetnsError(f"{host.device} in {host.ns} did not come up within {timeout:g}s")

    def close(self) -> None:
        """End what ``popen``/``peer`` started that is still running, then remove every namespace."""
        for peer in self._peers:
            try:
                peer.close(timeout=5.0)
            except Exception:  # keep cleaning up
                pass
        self._peers.clear()
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        for name in reversed(self._made):
            _run(["ip", "netns", "del", name], check=False)
        self._made.clear()

    # --- hosts ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self) -> Any:
        return iter(self.hosts.values())

    def names(self) -> list[str]:
        return list(self.hosts)

    def namespaces(self) -> list[str]:
        return [*(h.ns for h in self.hosts.values()), self.bridge_ns]

    # --- processes --------------------------------------------------------------------
    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run in ``host``'s namespace (``ip netns exec`` execs it: same pid)."""
        return ["ip", "netns", "exec", self.hosts[host].ns, *argv]

    def env(self, host: str, base: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
        """An environment whose UCX moves bytes over TCP through ``host``'s veth only."""
        env = dict(os.environ if base is None else base)
        env.update({"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.hosts[host].device, "NIXL_LOG_LEVEL": "WARN"})
        env.update(extra)
        return env

    def run(self, host: str, argv: Sequence[str], *, timeout: float = 60.0, check: bool = True,
            env: Mapping[str, str] | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(self.command(host, argv), input=stdin, capture_output=True, text=True,
                              timeout=timeout, env=None if env is None else dict(env))
        if check and proc.returncode != 0:
            raise NetnsError(f"{argv[0]} in {host} exited {proc.returncode}: {(proc.stderr or proc.stdout)[-2000:]}")
        return proc

    def popen(self, host: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """A process in ``host``'s namespace, killed and reaped by ``close()`` if still running."""
        proc = subprocess.Popen(self.command(host, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def python(self, host: str, code: str, *args: str, timeout: float = 60.0,
               env: Mapping[str, str] | None = None) -> str:
        """Run Python ``code`` (``sys.argv[1:]`` = ``args``) in ``host``'s namespace; its stdout."""
        return self.run(host, [sys.executable, "-c", code, *args], timeout=timeout, env=env).stdout

    def peer(self, host: str, factory: str, kwargs: dict[str, Any] | None = None, *,
             env: Mapping[str, str] | None = None) -> Any:
        """A ``SubprocessPeer`` whose child runs in ``host``'s namespace with ``env(host)``
        (plus ``env``); closed by ``close()`` if still open."""
        from kvxfer.testing.subprocess_peer import SubprocessPeer  # noqa: PLC0415 - keeps this module's import light

        peer = SubprocessPeer(factory, kwargs, env={**self.env(host), **(env or {})},
                              prefix=["ip", "netns", "exec", self.hosts[host].ns])
        self._peers.append(peer)
        return peer

    def serve(self, host: str, name: str, argv: Sequence[str], log_dir: Path,
              env: Mapping[str, str] | None = None) -> Service:
        """``python -m kvxfer.cli ARGV --parent-watch`` (``serve``, ``router``) in ``host``'s
        namespace with ``env(host)``: stdout carries its ready line, stderr goes to
        ``log_dir/NAME.log``. ``close()`` ends it if ``Service.stop`` did not."""
        log = open(Path(log_dir) / f"{name}.log", "wb")  # noqa: SIM115 - closed by Service.stop
        try:
            proc = self.popen(host, [sys.executable, "-m", "kvxfer.cli", *argv, "--parent-watch"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                              env={**self.env(host), **(env or {})})
        except BaseException:
            log.close()
            raise
        return Service(name, proc, log)

    def http(self, host: str, method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, str]:
        """An HTTP request from ``host``'s namespace (a short Python child, urllib): (status, body)."""
        out = self.python(host, _HTTP_CLIENT, method, url, json.dumps(body), str(timeout), timeout=timeout + 30)
        status, _, text = out.partition("\n")
        return int(status), text

    # --- counters ---------------------------------------------------------------------
    def counters(self, host: str) -> dict[str, int]:
        """``host``'s veth counters (rx/tx bytes and packets), as the kernel counts them."""
        return counters(self.hosts[host].ns, self.hosts[host].device)

    def dropped(self, host: str) -> int:
        """Packets ``host``'s nftables rules dropped so far (0 without rules)."""
        done = _run(["ip", "netns", "exec", self.hosts[host].ns, "nft", "-j", "list", "table", "inet", NFT_TABLE],
                    check=False)
        if done.returncode != 0:
            return 0
        total = 0
        for item in json.loads(done.stdout).get("nftables", []):
            for expr in item.get("rule", {}).get("expr", []):
                if "counter" in expr:
                    total += int(expr["counter"]["packets"])
        return total

    # --- faults -----------------------------------------------------------------------
    def cut(self, host: str) -> None:
        """Take ``host``'s link down at the bridge: nothing passes until ``restore``."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.hosts[host].port, "down"])

    def restore(self, host: str) -> None:
        """Bring ``host``'s link back; neighbour entries that failed meanwhile are forgotten
        (else the first connection may still get "No route to host")."""
        _run(["ip", "-n", self.bridge_ns, "link", "set", self.hosts[host].port, "up"])
        self._wait_up(self.hosts[host])
        for h in self.hosts.values():
            _run(["ip", "-n", h.ns, "neigh", "flush", "dev", h.device], check=False)

    def loss(self, host: str, percent: float) -> None:
        """Drop ``percent`` % of the packets arriving at ``host`` (replaces its rules)."""
        if not 0 < percent < 100:
            raise ValueError(f"percent must be in (0, 100), got {percent!r}")
        per_million = round(percent * 10_000)
        self._rules(host, [f"numgen random mod 1000000 < {per_million} counter drop"], [])

    def corrupt(self, host: str, per_mille: int, *, min_bytes: int = 8000, offset: int = 1000) -> None:
        """Overwrite 4 bytes, ``offset`` bytes into the TCP payload, of ``per_mille`` of every
        thousand TCP packets longer than ``min_bytes`` arriving at ``host`` (replaces its rules;
        ``dropped`` counts the packets changed)."""
        if not 0 < per_mille < 1000 or offset + 4 > min_bytes:
            raise ValueError(f"per_mille must be in (0, 1000) and the bytes inside the packets, got {per_mille!r}, "
                             f"offset {offset!r}")
        self._rules(host, [f"meta l4proto tcp meta length > {min_bytes} numgen random mod 1000 < {per_mille} "
                           f"counter @ih,{8 * offset},32 set 0x5a5a5a5a"], [])

    def blackhole(self, host: str) -> None:
        """Drop every packet to and from ``host`` silently, loopback spared (replaces its rules)."""
        self._rules(host, ['iifname != "lo" counter drop'], ['oifname != "lo" counter drop'])

    def clear(self, host: str) -> None:
        """Remove ``host``'s rules."""
        _run(["ip", "netns", "exec", self.hosts[host].ns, "nft", "delete", "table", "inet", NFT_TABLE], check=False)

    def rules(self, host: str) -> str:
        """``host``'s rule set as nft lists it (with the rules' packet counters)."""
        return _run(["ip", "netns", "exec", self.hosts[host].ns, "nft", "list", "ruleset"]).stdout

    def _rules(self, host: str, input_rules: Sequence[str], output_rules: Sequence[str]) -> None:
        def chain(name: str, hook: str, rules: Sequence[str]) -> str:
            body = "".join(f"    {rule}\n" for rule in rules)
            return f"  chain {name} {{\n    type filter hook {hook} priority filter; policy accept;\n{body}  }}\n"

        script = (f"table inet {NFT_TABLE}\ndelete table inet {NFT_TABLE}\n"
                  f"table inet {NFT_TABLE} {{\n{chain('input', 'input', input_rules)}"
                  f"{chain('output', 'output', output_rules)}}}\n")
        with tempfile.NamedTemporaryFile("w", suffix=".nft", delete=False) as f:
            f.write(script)
        try:
            _run(["ip", "netns", "exec", self.hosts[host].ns, "nft", "-f", f.name])
        finally:
            os.unlink(f.name)


def counters(ns: str, device: str = DEVICE) -> dict[str, int]:
    """A device's counters in namespace ``ns`` (``ip -s -j link``): rx/tx bytes and packets."""
    link = json.loads(_run(["ip", "-n", ns, "-s", "-j", "link", "show", "dev", device]).stdout)[0]
    stats = link["stats64"]
    return {"rx_bytes": int(stats["rx"]["bytes"]), "tx_bytes": int(stats["tx"]["bytes"]),
            "rx_packets": int(stats["rx"]["packets"]), "tx_packets": int(stats["tx"]["packets"])}


class Service:
    """A ``kvxfer serve`` or ``kvxfer router`` in a namespace (``Hosts.serve``)."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], log: IO[bytes]) -> None:
        self.name = name
        self.proc = proc
        self._log = log
        self.info: dict[str, Any] = {}

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def wait_ready(self, timeout: float = 180.0) -> dict[str, Any]:
        """Its ready line (one JSON object on stdout), or NetnsError with its log's tail."""
        assert self.proc.stdout is not None
        buf = b""
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                chunk = os.read(self.proc.stdout.fileno(), 4096) if left > 0 and sel.select(left) else None
                if not chunk:
                    why = "did not announce itself" if chunk is None else f"exited ({self.proc.wait(10)})"
                    raise NetnsError(f"{self.name} {why} within {timeout:g}s; log:\n{self.log_tail()}")
                buf += chunk
        self.info = json.loads(buf.split(b"\n", 1)[0])
        return self.info

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> int | None:
        """Close its stdin (its parent watch ends it), then SIGTERM, then SIGKILL; reaped."""
        try:
            return end_process(self.proc, timeout, grace=timeout)
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
            self._log.close()


_HTTP_CLIENT = """
import sys, urllib.error, urllib.request
method, url, body, timeout = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
data = None if body == "null" else body.encode()
request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
try:
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        status, text = answer.status, answer.read().decode()
except urllib.error.HTTPError as error:
    status, text = error.code, error.read().decode()
sys.stdout.write(f"{status}\\n{text}")
"""
