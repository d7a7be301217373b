"""``python -m sn_trainer.verify``: prove it on your model, from the command line (``Trainer.verify``)."""
