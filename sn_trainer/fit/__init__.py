"""What ``Trainer.fit`` does, in order: resolve one frozen run (``resolve``, with the rehearsal of the
user's code in ``preflight`` and every ``auto`` decided in ``decide``), run its launches with their
restarts (``session``), and report what ran (``result``)."""
