"""The shared-memory core: a segment per group of processes on one machine, its barrier, liveness and
broken state, and the collectives that move data through it. The Trainer's ``comm=shm`` reducer
(engine/collectives/in_node.py) and the "sn" torch.distributed backend (distributed/) both run on it."""
