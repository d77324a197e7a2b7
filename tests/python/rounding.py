"""Floating-point error bounds that the tests' tolerances are derived from (Higham, Accuracy and
Stability of Numerical Algorithms, ch. 3)."""

FP32_UNIT_ROUNDOFF = 2.0 ** -24
BF16_UNIT_ROUNDOFF = 2.0 ** -8


def gamma(n: int, unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> float:
    """gamma_n = n u / (1 - n u): a floating-point sum of n + 1 terms, in any order, is within
    gamma_n times the sum of the terms' magnitudes of the exact sum; n rounded operations in a row
    on one value stay within gamma_n of it, relatively. u = 2^-24 for fp32 (round to nearest)."""
    return n * unit_roundoff / (1 - n * unit_roundoff)


def reduction_bound_scale(world: int, factor: float, unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> float:
    """Two reductions of the W ranks' terms g_r divided by `factor`, in different orders (FSDP2's
    collective and TIDE's programs), differ per element by at most this times sum_r |g_r|, the
    magnitudes summed in fp32: each sum is within gamma(W - 1) sum_r |g_r| of the exact one
    whatever its order, and dividing by the factor or multiplying by fl(1/factor), before or after
    summing, adds at most 3u of the result, so (2 gamma(W - 1) + 3u) / factor <= gamma(2W + 2) /
    factor; (1 + gamma(W)) takes the fp32 sum of the magnitudes up to at least the exact one."""
    return gamma(2 * world + 2, unit_roundoff) * (1 + gamma(world)) / factor
