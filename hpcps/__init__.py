"""hpcps: distributed training of neural networks on CPU clusters with MPI."""

__version__ = "0.1.0"
