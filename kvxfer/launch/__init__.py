"""``kvxfer launch``: prefill workers, decode workers and the router as actors of a Ray cluster.

- ``placement``: what each role asks of Ray (CPUs, GPUs, a node resource), placement-group
  bundles, and the checks that refuse a placement no node could give (no Ray import).
- ``actors``: the process each actor runs (``kvxfer serve``, ``kvxfer router``, ``etcd``) in a
  session of its own, on its node's address, its GPUs from Ray; ``stop()`` ends its whole
  process tree (no Ray import: the launcher wraps the classes with ``ray.remote``).
- ``launcher``: places and starts them (etcd, workers, router, in that order), watches them,
  stops them; ``cli``: the command. ``guard``: ends a command (etcd) when its actor is gone.

Ray is an extra (``pip install 'kvxfer[ray]'``); only ``launcher`` and ``cli`` import it.
"""
