"""One training step and one evaluation in a worker (``replica``): the steps compared with one
process's (``verification``, the one process in ``reference``), each optimizer's part (``phases``),
batch norm over the global batch (``batchnorm``), and what workers publish before the reduce, the
parameters a backward pass reached among it (``board``). What a step computes (the objective,
gathering, the flat layout) is the shared vocabulary in ``sn_trainer.recipe``."""
