"""What is read from and written to disk: datasets (``data``) and HDF5 checkpoints; no MPI."""
