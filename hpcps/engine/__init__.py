"""Hogwild threads inside a rank over the compiled kernels (``hpcps.kernels``); no MPI.

hogwild: the MLP engine; conv_hogwild: the conv-net engine (whole models, and the partitions of a
model-parallel conv net); partitioned_hogwild: threads in the partitions of a model-parallel
replica (handed their exchange).
"""
