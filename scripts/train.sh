#!/usr/bin/env bash
# The main job, set-up included: LeNet on Fashion-MNIST on every physical core. The set-up is
# training's only (scripts/setup.sh without `test`): no test toolchain is installed.
# Extra arguments are Hydra overrides: bash scripts/train.sh batch_size=128 workers=2
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m sn_trainer "$@"
