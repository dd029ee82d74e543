"""Engine adapters: third-party serving engines whose own KV kvxfer lends in place.

Each adapter is a package behind its own extra (``pip install 'kvxfer[transformers]'``) and
builds on the lender (``kvxfer.lender.engine_kv``, ``kvxfer.lender.external``); no backend
imports an adapter, and an adapter imports no backend: the caller picks the transport.
"""
