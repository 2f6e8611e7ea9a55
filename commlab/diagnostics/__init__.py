"""Diagnostics: the seed's DP/DDP decision tree (advise) and its troubleshooting checks
(doctor)."""
