"""kvxfer imports NIXL through one loader, which spares the torch import that NIXL's meta
package makes where torch is a CPU build, and picks the same NIXL wheel as a plain import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvxfer.backends.nixl.loader import _torch_cuda_on_disk

_PROBE = """
import json, sys
{load}
print(json.dumps({{"torch": "torch" in sys.modules, "wheel": sys.modules["nixl._api"].__name__}}))
"""


def _probe(load: str) -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(load=load)], capture_output=True, text=True,
                         timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_loader_picks_the_wheel_a_plain_import_picks_and_leaves_a_cpu_torch_unimported() -> None:
    pytest.importorskip("nixl._api", reason="needs the nixl package")
    loaded = _probe("from kvxfer.backends.nixl.loader import nixl_modules; nixl_modules()")
    plain = _probe("import nixl._api")
    assert loaded["wheel"] == plain["wheel"]
    if _torch_cuda_on_disk() is None:  # CPU torch (or none): NIXL's own import would load it
        assert loaded["torch"] is False
