"""What-if: the seed's DP vs DDP table predicted from first principles (the model's
operations on meta tensors, a hardware profile's datasheet numbers, DDP's buckets and
DP's parameter-server traffic), checked against commlab.compare wherever it measures."""
