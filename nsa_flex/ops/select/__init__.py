"""nsa_flex::select_blocks: the registration and torch twin (op), the streaming Triton kernel (kernels)."""
