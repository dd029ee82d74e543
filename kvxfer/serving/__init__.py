"""kvxfer.serving: what the worker and the router both serve with, owned by neither: HTTP on
aiohttp (``http``: the server, ``server``, and the pooled client, ``client``, over the shared
vocabulary of ``exchange``), Prometheus metrics on prometheus_client (``metrics``), the
start-up checks (``startup``), the commands' argument parser (``command``: a usage error in one line), the readiness announcement a launched process prints
(``announce``) and discovery through etcd (``discovery``: a worker's registration, a router's
membership). The worker and the router import this, never each other."""
