"""flash-attn 2.x's `flash_attn.layers` helpers that attention code imports beside the kernels (rotary: apply_rotary_emb,
apply_rotary_emb_qkv_, apply_rotary_emb_kv_, RotaryEmbedding)."""
