"""Peer backends and the helpers they share. Each backend is imported from its own module
(``kvxfer.backends.loopback``, ``.nixl``, ``.ipc``, ``.ucx``) so that a missing optional
transport never breaks another."""
