#!/usr/bin/env bash
# Set up a fresh Debian machine with Python 3.11, by need. Safe to run again; it skips what is there.
#   bash scripts/setup.sh        training: the Debian packages a run reads (Fashion-MNIST, the
#                                allocators), a virtualenv (.venv) holding sn_trainer and what it
#                                imports (pip install -e .), and the C core of the collectives
#   bash scripts/setup.sh test   the same, and the test toolchain: pip install -e ".[test]"
#                                (transformers, datasets, Lightning, MLflow, Jupyter, ...), and
#                                iproute2 (two nodes in network namespaces) and tmux (a real
#                                terminal for the progress bar)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-train}"
# The allocators workers may run with: allocator=jemalloc or tcmalloc.
PACKAGES="dataset-fashion-mnist libjemalloc2 libtcmalloc-minimal4"
TARGET="."
case "$MODE" in
    train) ;;
    test) PACKAGES="$PACKAGES iproute2 tmux"; TARGET=".[test]" ;;
    *) echo "usage: bash scripts/setup.sh [test]  (no argument: what training needs)" >&2; exit 2 ;;
esac
if ! dpkg -s $PACKAGES > /dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq $PACKAGES
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch==2.14.1 and torchvision==0.29.1 are pinned in pyproject.toml. pip resolves every dependency
# again even when all are there (about 10 s): skipped while pyproject.toml is the one this mode (or,
# for training, the test mode) last installed from. rm .venv/.installed-* to install again.
if ! cmp -s pyproject.toml ".venv/.installed-$MODE" && ! cmp -s pyproject.toml .venv/.installed-test; then
    .venv/bin/python -m pip install -q --disable-pip-version-check -e "$TARGET"
    cp pyproject.toml ".venv/.installed-$MODE"
fi
# The shared-memory collectives' C core, built with this machine's compiler (without one they run in Python).
.venv/bin/python -m sn_trainer.shm.native || true
