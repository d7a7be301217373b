"""What the workers exchange: gradients summed into shards and barriers (``comm``, reducers by name)
and PowerSGD between nodes (``compression``). Tensors and torchmetrics states through the exact
float64 sum are ``sn_trainer.recipe``'s."""
