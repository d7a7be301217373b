"""What ``Trainer.fit`` does, in order: resolve one frozen run (``resolve``, with bad input refused in
``checks``, the rehearsal of the user's code in ``preflight``, the objectives settled on what it found in
``settle`` and every ``auto`` decided in ``decide``), run its launches with their restarts (``session``),
and report what ran (``result``)."""
