"""A pinning torchrun: ``python -m sn_trainer.launch [torchrun's flags] script.py args`` starts
torch.distributed.run's own elastic agent, each local rank pinned to its own physical cores with
as many intra-op threads (``plan``: what each rank gets; ``child``: a rank applying it)."""
