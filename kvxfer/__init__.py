"""kvxfer: KV-cache transport for disaggregated LLM serving.

Importing the package imports nothing heavy: the contract, lenders and backends are
separate modules so that ``kvxfer.contract`` stays free of torch and NIXL.
"""

from kvxfer.contract.errors import KvxferError

__version__ = "0.1.0"
__all__ = ["KvxferError", "__version__"]
