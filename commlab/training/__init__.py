"""Training integration, what a training script imports: DDP communication hooks
(`hooks`, with `membership` for the groups their states make) and FSDP2's all-gathers
and reduce-scatters through the families (`fsdp`). The experiments built on them are
commlab.experiments'."""
