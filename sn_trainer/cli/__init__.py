"""The command line, ``python -m sn_trainer key=value ...``: its settings, its catalogue of datasets,
models and optimizers by name, and one job (data, model, fit, the files it writes); and the tuner's
command line, ``python -m sn_trainer.tuner --predict ...`` (``tune.py``)."""
