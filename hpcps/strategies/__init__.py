"""Training strategies, one module each, found by :mod:`.registry` (each exports ``STRATEGY``).

``python -m hpcps.train --help`` lists them with their options. Shared pieces:
:mod:`.registry` (what a strategy declares), :mod:`.context` (what every role is handed;
checkpoints, evaluation), :mod:`.loop` (the replica loop of the SGD strategies),
:mod:`.gradients` (a replica's gradient: compiled engine, NumPy or Hogwild threads).
"""
