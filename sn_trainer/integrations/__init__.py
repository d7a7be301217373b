"""Adapters to third-party frameworks: a model or a run of theirs handed to sn_trainer as it is.

``lightning`` (with ``lightning_module``, ``lightning_stand_in`` and ``lightning_manual``) lets
``Trainer.fit`` take a LightningModule; ``ray`` (with ``ray_placement``) runs a Ray Train script's
workers on the "sn" backend, each pinned (``TorchTrainer(torch_config=SNConfig())``), and (with
``ray_nodes``) sn_trainer's own Trainer on every node of a Ray cluster (``SNNodesConfig``). Each framework is
imported only for a model or run that comes from it; ``ray`` is the ``sn_trainer[ray]`` extra's own
module, which nothing else imports.
"""
