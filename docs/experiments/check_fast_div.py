"""Checks FastDiv (csrc/flashcore/params.h, transcribed below): the multiplier and shift of every divisor that
matters, and quotients against exact division over the edge cases (0, multiples, neighbours, 2^31 - 1) and random
dividends below 2^31, including that the 32-bit sum hi + x never overflows. Run: python3 check_fast_div.py -> 0."""
import random


def make(d):
    shift = 0
    while (1 << shift) < d:
        shift += 1  # ceil(log2(d))
    mult = ((1 << 32) * ((1 << shift) - d)) // d + 1
    assert 0 < mult < (1 << 32), (d, mult)
    return mult, shift


def div(mult, shift, x):
    hi = (x * mult) >> 32
    assert hi + x < (1 << 32), (x, mult)
    return (hi + x) >> shift


random.seed(0)
divisors = list(range(1, 4097)) + [2**k + e for k in range(12, 31) for e in (-1, 0, 1)]
divisors += [random.randrange(1, 2**31) for _ in range(5000)]
bad = 0
for d in divisors:
    if not 1 <= d < 2**31:
        continue
    mult, shift = make(d)
    top = (2**31 - 1) // d * d
    xs = [0, 1, d - 1, d, d + 1, 2 * d - 1, 2 * d, top - 1, top, 2**31 - 2, 2**31 - 1]
    xs += [random.randrange(0, 2**31) for _ in range(200)]
    for x in xs:
        if 0 <= x < 2**31 and div(mult, shift, x) != x // d:
            bad += 1
print(bad)
