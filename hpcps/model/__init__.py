"""The networks and their update rules, on flat float32 parameter vectors; no MPI.

mlp: the MLP and PartitionedMLP (model parallelism, handed its exchange); convnet: conv, pool
and fc layers; layers: the fc and conv passes both nets share; spec: the ``--model`` grammar
and presets; optim: SGD, momentum, Adagrad, L-BFGS; ctr: embedding tables and fc layers for
click-through data; metrics: AUC and log loss.
"""
