"""flash-attn 2.x's `flash_attn.layers` helpers that attention code imports beside the kernels (rotary)."""
