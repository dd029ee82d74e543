"""kvxfer.serving: what the worker and the router both serve with, owned by neither: the
HTTP/1.1 server and client (``http``), Prometheus metrics (``metrics``) and the readiness
announcement a launched process prints (``announce``). The worker and the router import
this, never each other."""
