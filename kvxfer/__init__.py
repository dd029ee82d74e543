"""kvxfer: KV-cache transport for disaggregated LLM serving.

Importing the package imports nothing heavy and changes nothing in the process (no
environment variable, logging set-up, signal handler or thread): the contract, lenders and
backends are separate modules so that ``kvxfer.contract`` stays free of torch and NIXL, and
the UCX settings kvxfer needs go only to the UCX contexts it makes (``kvxfer.ucx_env``).
"""

from kvxfer.contract.errors import KvxferError

__version__ = "0.1.0"
__all__ = ["KvxferError", "__version__"]
