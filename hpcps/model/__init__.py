"""The networks and their update rules, on flat float32 parameter vectors; no MPI.

mlp: the MLP and PartitionedMLP (model parallelism, handed its exchange); convnet: conv, pool
and fc layers; spec: the ``--model`` grammar and presets; optim: SGD, momentum, Adagrad, L-BFGS.
"""
