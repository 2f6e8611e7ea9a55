"""What compare and predict both read off a mode's name."""


def is_sharded(mode: str) -> bool:
    """ZeRO-1's and FSDP's modes (zero1, fsdp, fsdp:<algorithm>, fsdp:noreshard): the
    ones whose ranks hold a shard of the training state."""
    return mode == "zero1" or mode == "fsdp" or mode.startswith("fsdp:")
