"""The layout of a torchrun job and its pieces, applied to a built model from outside
(DESIGN habit 4): `parallel` (Layout, DeviceMesh, DDP / FSDP2 / HSDP), `tensor_parallel`,
`expert_parallel`, `context_parallel`, `dcp` (sharded checkpoints) and `plan` (memory and
communication of a layout)."""
