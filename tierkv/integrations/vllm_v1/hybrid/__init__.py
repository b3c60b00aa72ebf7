"""Hybrid models in the vLLM connector: several KV cache groups (sliding window, Mamba / linear
attention, MLA beside full attention), each stored and loaded on its own and hit jointly.

``groups`` reads vLLM's KV cache groups and says which chunks a hit needs of each;
``scheduler`` plans per-step saves and per-request loads (bookkeeping, no tensors); ``worker``
moves the bytes, one connector per group; ``state_pages`` is the connector of a recurrent
state group; ``setup`` is what the connector reads at start-up and the pins a save holds.
"""
