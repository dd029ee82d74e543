"""The namespace kit itself: hosts reach each other only through their veths, the root
namespace gets nothing, faults do what they say, and everything is removed, on errors too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from kvxfer.testing.netns import BRIDGE, PREFIX, SUBNET, Hosts, NetnsError, list_namespaces, sweep_stale

pytestmark = [pytest.mark.netns, pytest.mark.timeout(120)]

# Listens on the port, answers each connection with 256 KiB and closes it.
SERVER = ("import socket\ns = socket.socket(); s.bind(('0.0.0.0', 5001)); s.listen()\n"
          "while True:\n    c, _ = s.accept()\n    try:\n        c.sendall(b'x' * 262144)\n"
          "    except OSError:\n        pass  # a client that gave up\n    c.close()\n")
# Connects, counts the bytes until the server closes: "got N" or "error ...".
CLIENT = ("import socket, sys\ntry:\n    c = socket.create_connection((sys.argv[1], 5001), timeout=float(sys.argv[2]))\n"
          "    n = 0\n    while (d := c.recv(65536)):\n        n += len(d)\n    print('got', n)\n"
          "except OSError as e:\n    print('error', type(e).__name__)\n")


def fetch(hosts: Hosts, host: str, ip: str, timeout: float = 2.0) -> str:
    return hosts.python(host, CLIENT, ip, str(timeout)).strip()


def in_root(what: str) -> str:
    """The root namespace's links or addresses, as ``ip -j`` lists them."""
    return subprocess.run(["ip", "-j", what, "show"], capture_output=True, text=True, check=True).stdout


def ours_in_root(hosts: Hosts) -> list[str]:
    """Links or addresses of ``hosts`` that the root namespace has (none should be there).
    Other work on the machine may add and remove its own devices meanwhile: only ours count."""
    names = {h.port for h in hosts} | {BRIDGE}
    links = [link["ifname"] for link in json.loads(in_root("link")) if link["ifname"] in names]
    addresses = [a["local"] for link in json.loads(in_root("addr")) for a in link.get("addr_info", [])
                 if a.get("local", "").startswith(SUBNET + ".")]
    return links + addresses


def test_hosts_reach_each_other_through_their_veths_only() -> None:
    with Hosts(["a", "b"]) as hosts:
        names = hosts.namespaces()
        assert all(name.startswith(f"{PREFIX}{os.getpid()}-") for name in names)
        assert set(names) <= set(list_namespaces())
        assert ours_in_root(hosts) == []  # nothing was added to the root namespace
        assert hosts.run("a", ["ls", "/sys/class/net"]).stdout.split() == ["eth0", "lo"]  # its own /sys
        server = hosts.popen("b", [sys.executable, "-c", SERVER])
        before = hosts.counters("a")
        deadline = time.monotonic() + 60
        while (got := fetch(hosts, "a", hosts["b"].ip)) != "got 262144" and time.monotonic() < deadline:
            time.sleep(0.2)  # the server is starting
        assert got == "got 262144", "the server in b never answered"
        assert hosts.counters("a")["rx_bytes"] - before["rx_bytes"] >= 262144
        assert fetch(hosts, "a", hosts["b"].ip) == "got 262144"

        hosts.cut("b")
        got = fetch(hosts, "a", hosts["b"].ip)
        assert got.startswith("error"), f"through a cut link: {got}"
        hosts.restore("b")
        got = fetch(hosts, "a", hosts["b"].ip)
        assert got == "got 262144", f"after restore: {got}"

        hosts.blackhole("b")  # silent: the client times out, it is not refused
        got = fetch(hosts, "a", hosts["b"].ip, 1.0)
        assert got == "error TimeoutError", f"blackholed: {got}"
        assert hosts.dropped("b") > 0
        hosts.clear("b")
        assert hosts.dropped("b") == 0
        got = fetch(hosts, "a", hosts["b"].ip)
        assert got == "got 262144", f"after clear: {got}"

        hosts.loss("b", 20)
        for _ in range(5):
            # A deadline, not a wait: four lost SYNs in a row (0.2**4, about once in 600
            # connects) back off 1+2+4+8 s before the fifth, and a 20 s deadline failed once.
            got = fetch(hosts, "a", hosts["b"].ip, 90.0)
            assert got == "got 262144", f"20% loss: {got}"  # TCP retransmits
        assert hosts.dropped("b") > 0
        assert "numgen random mod 1000000 < 200000" in hosts.rules("b")
    assert server.poll() is not None  # close() ended it
    assert not set(names) & set(list_namespaces())


def test_everything_is_removed_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError, match="boom"), Hosts(["a"]) as hosts:
        names = hosts.namespaces()
        hosts.popen("a", ["sleep", "600"])
        hosts.blackhole("a")
        raise RuntimeError("boom")
    assert not set(names) & set(list_namespaces())


def test_a_failed_set_up_removes_what_it_made_and_stale_namespaces_are_swept() -> None:
    with pytest.raises(ValueError):
        Hosts(["a", "a"])
    hosts = Hosts(["a", "b"], subnet="10.213.0.999")  # an address `ip` refuses
    with pytest.raises(NetnsError, match="10.213.0.999"):
        hosts.open()
    assert not set(hosts.namespaces()) & set(list_namespaces())

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that is gone: its namespaces are stale
    stale = f"{PREFIX}{dead.pid}-0-a"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    try:
        assert stale in sweep_stale()
        assert stale not in list_namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
