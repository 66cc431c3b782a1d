"""A model runner around the attention setup: model stack, pools, CUDA graphs, verification."""
