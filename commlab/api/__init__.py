"""The contract of a call: one module per collective (validation, cached plans,
agreement, async handles, torch.distributed's semantics), the lanes that order a
group's calls, and the `commlab` torch.distributed backend that serves them. Above the
algorithms and transports; the shared facts (errors, groups, reduction, chunks) are
below, in commlab.core."""
