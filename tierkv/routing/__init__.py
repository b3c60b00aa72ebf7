"""The tier router: which tier takes a store (the first that admits), where chunks are
(``locate``), the one-pass read into a sink (``reads``), write-through copies to the
tiers below (``fill``), write-back demotion bookkeeping and the off-loop copy helper.
"""
