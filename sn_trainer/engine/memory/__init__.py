"""Where a run's memory lies and how much it takes: the flat buffer's geometry (``layout``), the
parameters held once in shared memory (``shared``), optimizer state between shards and parameters
(``state``), and the workers' peak memory counted by PSS (``peak``)."""
