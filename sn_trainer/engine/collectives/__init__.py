"""What the workers exchange: gradients summed into shards and barriers (``comm``, reducers by name),
PowerSGD between nodes (``compression``), and what is built on the exact float64 sum: tensors
(``by_sums``) and torchmetrics states (``metric_states``)."""
