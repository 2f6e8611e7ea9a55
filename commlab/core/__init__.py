"""The contract of one call: the API (validation, plans, AVG, layouts, async lanes) and
the facts every layer below shares (groups, errors, reduction semantics, splits, the
compiled extension)."""
