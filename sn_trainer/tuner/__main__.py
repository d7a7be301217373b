"""``python -m sn_trainer.tuner --predict ...``: the tuner's command line under the tuner's name. It
calibrates through the Trainer, a layer above the tuner, so it lives at the command line's layer
(``cli/tune.py``); this file only opens it and imports nothing else (``tests/test_structure.py``)."""
import sys

from ..cli.tune import main

if __name__ == "__main__":
    sys.exit(main())
