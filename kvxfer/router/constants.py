"""The router's constants a command line or a client needs without the router itself (which
imports aiohttp): its failure policies, worker selections, the shape of its request keys and
its streams' keep-alive."""

POLICIES = ("fail", "recompute")
"""What the router does when a transfer fails: fail the request by name, or recompute it."""

SELECTIONS = ("round_robin", "least_outstanding")
"""How the router picks a worker of a role."""

KEY_PATTERN = r"r[0-9a-f]{12}-\d+"
"""The shape of the ids the router gives the workers (``Router._key``), for tools that read
them out of reasons and logs."""

KEEPALIVE_S = 5.0
"""The longest a stream stays silent: the router may wait on its workers for minutes
between two tokens (a stalled transfer, then a recompute elsewhere), and its own timers end
that wait with the failure or the recompute. The "waiting" events (NDJSON) and comments
(SSE) let a client tell such a wait from a router that hung, with a short silence limit of its own."""
