"""Model Runner V2 (GPUs): speculator, tree sampler, step state, verify layout and CUDA graphs."""
