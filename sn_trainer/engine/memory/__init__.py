"""Where a run's memory lies and how much it takes: the parameters held once in shared memory
(``shared``), optimizer state between shards and parameters (``state``), and the workers' peak
memory counted by PSS (``peak``). The flat buffer's geometry is ``sn_trainer.recipe.flat_layout``."""
