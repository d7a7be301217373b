"""What one step computes, in words both sides of the run share: the launcher's rehearsal, proof
and checkpoints, and the workers that train. The user's loss as a sum and a count (``objective``),
what a step function gathers across workers (``gather``) and where in the run it is called
(``position``, both set through ``ambient``), the flat buffer's geometry (``flat_layout``), each
optimizer's schedule (``schedule``), and what is built on the exact float64 sum: tensors
(``by_sums``) and torchmetrics states (``metric_states``). It starts no process and holds no
shared memory: that is the engine's."""
