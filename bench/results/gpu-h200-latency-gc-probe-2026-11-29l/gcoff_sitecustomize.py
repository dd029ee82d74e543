# Probe only: every Python process started with this directory on PYTHONPATH runs with the
# cyclic garbage collector off (the bench's spawned decode child too), to see what GC costs the tail.
import gc

gc.disable()
