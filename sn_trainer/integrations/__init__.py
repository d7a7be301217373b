"""Adapters to third-party frameworks: a model or a run of theirs handed to sn_trainer as it is.

``lightning`` (with ``lightning_module``, ``lightning_stand_in`` and ``lightning_manual``) lets
``Trainer.fit`` take a LightningModule; the coming Ray integration will live here too. Each
framework is imported only for a model or run that comes from it.
"""
