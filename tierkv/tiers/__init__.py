"""One backend's handle: ``Tier`` owns every call into its backend (put, get-into, get,
contains, delete), its counters, breaker, speed, admission and memory-pressure state.
The router above holds a list of them.
"""
