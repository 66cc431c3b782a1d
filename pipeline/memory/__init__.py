"""The memory planner: what a start will hold on the device, estimated and checked before anything is allocated.

:mod:`~pipeline.memory.pools` sizes the KV pools and weighs the stack, :mod:`~pipeline.memory.allocator` models
PyTorch's caching allocator, :mod:`~pipeline.memory.graphs` estimates the decode CUDA graphs' private pool and
:mod:`~pipeline.memory.workspaces` checks the planned backend workspaces. Torch-free: ``plan`` runs it on a profile.
"""
