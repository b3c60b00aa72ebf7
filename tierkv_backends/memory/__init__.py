"""What the in-place memory tiers (``cpu``, ``gpu``) share: ``tier`` (``MemoryTier``: slabs, index,
holds, pressure) and ``slabs`` (the slab allocators).
"""
