"""Tensor parallelism: one model over several devices (or CPU processes) with torch.distributed.

``parallel`` holds a rank's view of its group and the collectives the model calls, ``sharding`` which slice of
each checkpoint tensor a rank owns, ``worker`` the loop a non-zero rank runs, and ``executor`` the engine-side
owner of the worker processes (start-up, one broadcast per step, the watchdog).
"""
