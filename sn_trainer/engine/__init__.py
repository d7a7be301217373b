"""The workers: what reads a resolved plan and trains it. Its interface is three modules here:
``plan`` (what the launcher resolved, read as is), ``worker`` (one worker process's life) and
``events`` (what workers tell the launcher). The rest lives in rooms, each importing only its
own and the ones before it (tests/test_structure.py checks the order):

- ``node/``: what this node is and where it stands: its CPU, cores, runtimes, place among nodes;
- ``memory/``: where the run's memory lies (the flat layout, shared parameters, optimizer state
  by shard) and how much the workers take;
- ``collectives/``: what workers exchange: gradient sums (the reducers), their compression
  between nodes, tensors and torchmetrics states through sums;
- ``processes/``: starting, watching, stopping and tearing down the worker processes;
- ``step/``: one training step and evaluation in a worker: the replica, the loss as sums and
  counts, each optimizer's phase, batch norm, the values the user's code reads.
"""
