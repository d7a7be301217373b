"""What the workers exchange: gradients summed into shards and barriers (reducers: ``reducer``, the
protocol; ``in_node`` and ``over_gloo``, the kinds; ``registry``, them by name), PowerSGD between nodes
(``compression``), and what is built on the exact float64 sum: tensors (``by_sums``) and torchmetrics
states (``metric_states``)."""
