"""kvxfer: KV-cache transport for disaggregated LLM serving.

Importing the package imports nothing heavy: the contract, lenders and backends are
separate modules so that ``kvxfer.contract`` stays free of torch and NIXL. It skips UCX's
InfiniBand module on a host without an RDMA device (``kvxfer.ucx_env`` says why).
"""

from kvxfer.contract.errors import KvxferError
from kvxfer.ucx_env import skip_unusable_ib

skip_unusable_ib()  # before any UCX loads: see kvxfer.ucx_env

__version__ = "0.1.0"
__all__ = ["KvxferError", "__version__"]
