"""One training step and one evaluation in a worker (``replica``, built from what the worker
receives: ``worker_spec``): its reducer (``reduction``), each phase's gradients summed over the
workers (``gradients``), the evaluation (``evaluation``), its share of a checkpoint
(``checkpoint_share``), the user's loss as a sum and a count (``objective``), the steps compared
with one process's (``verification``, the one process in ``reference``), each optimizer's part
(``phases``, ``schedule``), batch norm over the global batch (``batchnorm``), what workers publish
before the reduce, the parameters a backward pass reached among it (``board``), and what the
user's code reads while it runs (``gather``, ``position``, set through ``ambient``)."""
