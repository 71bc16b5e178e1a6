"""Checks the LaneOffsets formula (csrc/flashcore/cuda/sm80/fwd_sm80_mainloop.cuh) against SmemTile::chunk_offset
(csrc/flashcore/cuda/common/smem_tile.cuh, transcribed below) for every lane, warp and fragment of the mma.sync
forward's Q, K and V tiles at head dims 64-256 (64-column spans). Run: python3 check_lane_offsets.py -> 0."""
def chunk_offset(rows, cols, row, chunk):
    span_cols = 64 if cols % 64 == 0 else 32
    span_chunks = span_cols // 8
    span, c = chunk // span_chunks, chunk % span_chunks
    swz = (row & 7) if span_chunks == 8 else ((row >> 1) & 3)
    return span * (rows * span_cols) + row * span_cols + ((c ^ swz) << 3)
def lane_offsets(lr, b):
    return [lr * 128 + ((32 * k) ^ (16 * (b ^ (lr & 7)))) for k in range(4)]
bad = 0
for D in (64, 128, 192, 256):
    for rows_q, rows_kv in ((128, 64), (128, 32), (64, 32), (128, 128)):
        ksteps = D // 16
        for lane in range(32):
            a = lane_offsets((lane & 7) + ((lane >> 3) & 1) * 8, lane >> 4)
            bo = lane_offsets((lane & 7) + (lane >> 4) * 8, (lane >> 3) & 1)
            for warp_row0 in range(0, rows_q, 16):
                for ks in range(ksteps):
                    # Q (A operand)
                    row = warp_row0 + (lane & 7) + ((lane >> 3) & 1) * 8
                    old = chunk_offset(rows_q, D, row, 2 * ks + (lane >> 4)) * 2
                    new = (ks // 4) * rows_q * 128 + warp_row0 * 128 + a[ks % 4]
                    bad += old != new
            for ks in range(ksteps):
                for np_ in range(rows_kv // 16):
                    key = np_ * 16 + (lane & 7) + (lane >> 4) * 8
                    old = chunk_offset(rows_kv, D, key, 2 * ks + ((lane >> 3) & 1)) * 2
                    new = (ks // 4) * rows_kv * 128 + np_ * 16 * 128 + bo[ks % 4]
                    bad += old != new
            for kk in range(rows_kv // 16):
                for dp in range(D // 16):
                    key = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8
                    old = chunk_offset(rows_kv, D, key, 2 * dp + (lane >> 4)) * 2
                    new = (dp // 4) * rows_kv * 128 + kk * 16 * 128 + a[dp % 4]
                    bad += old != new
print("mismatches:", bad)
