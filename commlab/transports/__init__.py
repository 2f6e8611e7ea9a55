"""How bytes move: point-to-point over torch.distributed (p2p), shared memory between
CPU ranks of one host (shm), CUDA IPC between GPUs of one host (ipc), and the group
setup they share (setup)."""
