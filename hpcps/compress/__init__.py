"""Strom's compressed updates; no MPI.

codec: residual thresholding, 1-bit words, the Golomb-Rice codec; threshold: tau, fixed or
adapted to a target density.
"""
