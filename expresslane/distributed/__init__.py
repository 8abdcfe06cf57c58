"""Past one device: tensor parallelism over torch.distributed (process groups, parallel
layers, the rank-0 executor and the worker processes it drives)."""
