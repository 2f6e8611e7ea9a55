"""Training integration: DDP communication hooks, synthetic workloads, and the DP vs
DDP comparison."""
