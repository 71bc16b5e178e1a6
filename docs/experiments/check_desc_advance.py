"""Checks desc_advance (csrc/flashcore/cuda/sm90/smem_desc.cuh): desc_advance(make_smem_desc_sw128(a), b) == make_smem_desc_sw128(a + b)
for 16-byte-aligned shared addresses a and offsets b with a + b inside a block's shared memory, for the
leading-byte offsets the kernels use (a coarse grid: every 112th base byte, every 208th offset byte).
Run: python3 check_desc_advance.py -> 0."""
def make_desc(addr, lead, stride):
    d = ((addr & 0x3FFFF) >> 4)
    d |= ((lead >> 4) & 0x3FFF) << 16
    d |= ((stride >> 4) & 0x3FFF) << 32
    d |= 1 << 62
    return d
def advance(d, b):
    return (d & 0xFFFFFFFF00000000) | (((d & 0xFFFFFFFF) + (b >> 4)) & 0xFFFFFFFF)
bad = 0
LIMIT = 232448
for lead in (16, 64 * 128, 128 * 128, 176 * 128, 256 * 128):
    for a in range(0, LIMIT, 16 * 7):          # a coarse stride over bases (every 112 bytes) ...
        for b in range(0, min(LIMIT - a, 65536), 16 * 13):  # ... and offsets (every 208 bytes) up to 64 KiB
            bad += advance(make_desc(a, lead, 1024), b) != make_desc(a + b, lead, 1024)
print("mismatches:", bad)
