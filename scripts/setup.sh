#!/usr/bin/env bash
# Set up a fresh Debian machine with Python 3.11: the Fashion-MNIST package and a virtualenv
# (.venv) holding sn_trainer and its test tools. Safe to run again; it skips what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages: Fashion-MNIST; the allocators workers may run with (allocator=jemalloc or
# tcmalloc); for tests, iproute2 (two nodes in network namespaces) and tmux (a real terminal for
# the progress bar).
PACKAGES="dataset-fashion-mnist libjemalloc2 libtcmalloc-minimal4 iproute2 tmux"
if ! dpkg -s $PACKAGES > /dev/null 2>&1; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq $PACKAGES
fi
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch==2.14.1 and torchvision==0.29.1 are pinned in pyproject.toml.
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[test]"
# The shared-memory collectives' C core, built with this machine's compiler (without one they run in Python).
.venv/bin/python -m sn_trainer.shm.native || true
