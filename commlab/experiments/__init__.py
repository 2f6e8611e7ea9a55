"""The experiments behind the seed's table: DataParallel vs DDP vs ZeRO-1 vs FSDP measured
(`compare`) and predicted for hardware you do not have (`predict`), over synthetic or
your own models (`workloads`), in the modes `modes` names. The library they train with —
DDP hooks, FSDP's collectives — is commlab.training's."""
