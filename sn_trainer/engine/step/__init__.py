"""One training step and one evaluation in a worker (``replica``, built from what the worker
receives: ``worker_spec``): its reducer (``reduction``), each phase's gradients summed over the
workers (``gradients``), the evaluation (``evaluation``), its share of a checkpoint
(``checkpoint_share``), the steps compared with one process's (``verification``, the one process in
``reference``), each optimizer's part (``phases``), batch norm over the global batch
(``batchnorm``), and what workers publish before the reduce, the parameters a backward pass reached
among it (``board``). What a step computes (the objective, gathering, the flat layout, schedules)
is the shared vocabulary in ``sn_trainer.recipe``."""
