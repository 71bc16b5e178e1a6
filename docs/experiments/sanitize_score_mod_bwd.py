"""compute-sanitizer driver for the score-mod backward (Hopper: 80-row steps at head dims 96/128, 128-row at 64):
dense GQA and varlen (empty sequences, partial tiles), softcap alone and with ALiBi, a causal window and sinks,
fp16 and bf16. Run: compute-sanitizer --tool memcheck (or racecheck) python3 docs/experiments/sanitize_score_mod_bwd.py
"""
import torch
import flashcore

torch.manual_seed(0)
dev = "cuda"
for D in (64, 96, 128):
    for dtype in (torch.bfloat16, torch.float16):
        q = torch.randn(1, 4, 203, D, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(1, 2, 261, D, device=dev, dtype=dtype, requires_grad=True)
        v = torch.randn(1, 2, 261, D, device=dev, dtype=dtype, requires_grad=True)
        for kw in ({"softcap": 20.0}, {"softcap": 5.0, "is_causal": True, "window_size": (40, 0),
                                       "alibi_slopes": torch.rand(4, device=dev) * 0.2,
                                       "sinks": torch.randn(4, device=dev)}):
            out = flashcore.attention(q, k, v, enable_gqa=True, **kw)
            out.backward(torch.randn_like(out))
        lens = torch.tensor([0, 5, 0, 130, 300, 381], device=dev, dtype=torch.int32)
        cu = torch.cat([torch.zeros(1, device=dev, dtype=torch.int32), lens.cumsum(0).int()])
        qv = torch.randn(int(cu[-1]), 4, D, device=dev, dtype=dtype, requires_grad=True)
        kv = torch.randn(int(cu[-1]), 2, D, device=dev, dtype=dtype, requires_grad=True)
        vv = torch.randn(int(cu[-1]), 2, D, device=dev, dtype=dtype, requires_grad=True)
        o = flashcore.flash_attn_varlen_func(qv, kv, vv, cu, cu, 381, 381, causal=True, softcap=30.0)
        o.backward(torch.randn_like(o))
        print(D, dtype, flashcore.last_kernel("bwd"))
torch.cuda.synchronize()
print("done")
