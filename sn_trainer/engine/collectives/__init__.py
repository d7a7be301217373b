"""What the workers exchange: gradients summed into shards and barriers (reducers: ``reducer``, the
protocol; ``in_node`` and ``over_gloo``, the kinds; ``registry``, them by name) and PowerSGD between
nodes (``compression``). Tensors and torchmetrics states through the exact float64 sum are
``sn_trainer.recipe``'s."""
