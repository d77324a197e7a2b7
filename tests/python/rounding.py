"""Floating-point error bounds that the tests' tolerances are derived from (Higham, Accuracy and
Stability of Numerical Algorithms, ch. 3)."""

FP32_UNIT_ROUNDOFF = 2.0 ** -24


def gamma(n: int, unit_roundoff: float = FP32_UNIT_ROUNDOFF) -> float:
    """gamma_n = n u / (1 - n u): a floating-point sum of n + 1 terms, in any order, is within
    gamma_n times the sum of the terms' magnitudes of the exact sum; n rounded operations in a row
    on one value stay within gamma_n of it, relatively. u = 2^-24 for fp32 (round to nearest)."""
    return n * unit_roundoff / (1 - n * unit_roundoff)
