"""Model Runner V1 adapter (vLLM-CPU): proposer, tree sampler and step state over the runner-agnostic core."""
