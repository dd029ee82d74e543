"""Import NIXL without importing torch where torch has no CUDA.

Why: the ``nixl`` meta package picks its wheel (nixl_cu13, nixl_cu12) by the CUDA version of
whatever CUDA stack the process has loaded; with none loaded it reads torch's build version
off disk, and where that says no CUDA (a CPU build of torch) it imports torch to ask again.
That import costs about 3 s of CPU per process on a 2-core machine, paid by every doctor
probe, bench peer and test peer that needs NIXL and not torch. Where torch is not imported
yet and is absent or built without CUDA, the CUDA runtime bindings (``cuda.bindings``, which
NIXL's wheels load anyway) are imported first: the meta package then reads its version from
them. That is done only where NIXL has a wheel for that CUDA major, the one its fallback
(no CUDA version: the first installed of nixl_cu13, nixl_cu12) would pick where cuda-bindings
13 came with nixl_cu13. Where torch has CUDA, nothing changes.

This is the one place that imports ``nixl``; its meta package's selection rules are NIXL's
(``nixl_meta_utils.detect_cuda_major``, nixl 1.5), and a change there shows here first.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType


def _torch_cuda_on_disk() -> str | None:
    """torch's build CUDA version as its ``version.py`` states it, without importing torch;
    None where torch is absent, built without CUDA, or unreadable."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        return None
    namespace: dict[str, object] = {}
    try:
        with open(os.path.join(locations[0], "version.py"), encoding="utf-8") as f:
            exec(compile(f.read(), "torch/version.py", "exec"), namespace)  # noqa: S102 - torch's own file
    except (OSError, SyntaxError, ImportError, NameError):  # an unusual file: NIXL decides, as before
        return None
    cuda = namespace.get("cuda")
    return cuda if isinstance(cuda, str) and cuda else None


def _spare_torch_import() -> None:
    if "torch" in sys.modules or _torch_cuda_on_disk() is not None:
        return
    try:  # only where NIXL has a wheel for that CUDA: it would refuse to fall back otherwise
        major = importlib.metadata.version("cuda-bindings").split(".")[0]
        if importlib.util.find_spec(f"nixl_cu{major}") is None:
            return
        import cuda.bindings  # noqa: F401, PLC0415 - read by NIXL's wheel selection
    except (ImportError, ValueError):  # PackageNotFoundError is an ImportError
        pass


def nixl_modules() -> tuple[ModuleType, ModuleType]:
    """``(nixl._api, nixl._bindings)``; ImportError where NIXL is not installed."""
    _spare_torch_import()
    import nixl._api as api  # noqa: PLC0415 - optional transport, imported on use
    import nixl._bindings as bindings  # noqa: PLC0415

    return api, bindings


def nixl_api() -> ModuleType:
    """``nixl._api`` (see ``nixl_modules``)."""
    return nixl_modules()[0]
