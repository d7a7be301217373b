#!/usr/bin/env bash
# The test suite, set-up included (scripts/setup.sh test: training's set-up and the test toolchain),
# after ruff's check of the code, in tiers: the unit tier (-m unit: tests that start no process,
# seconds in all), then the tests that start processes:
# bash scripts/test.sh
# Then the equivalence core again with ATen's portable kernels (default), and on AVX2's its contract
# (-m contract: the modules that hold it against independent plain-PyTorch loops in float64) with the
# quick tests of the rest: every CPU's kernels round differently, and the exactness tests must hold on
# all of them. The core is the
# modules whose assertions rest on arithmetic (the step, models, optimizers, losses, collectives,
# decoded and augmented images); the modules about which samples are read in which order, and who
# owns a folder (streams, Hugging Face datasets, seams, run_owns, self-shuffling, order), run once:
# what they train is the arithmetic the core covers.
#
# bash scripts/test.sh --quick is the quick tier instead: the tests marked quick (-m quick: each test
# module's story told once, at its smallest), then those of the equivalence core on the two kernel sets.
# Any other argument goes to every pytest run.
#
# Past the unit tier, two test processes run modules side by side (pytest-xdist, a module to one
# process, so that its fixtures are made once; the longest first): while one test starts Python or
# waits for a peer, the other computes. A test marked alone (tests/conftest.py: it reads what the
# whole machine holds) runs with nothing beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=""  # --quick picks the tier and goes to no pytest run (it is no pytest option)
ARGS=()
for arg in "$@"; do
    if [ "$arg" = --quick ]; then QUICK=1; else ARGS+=("$arg"); fi
done
set -- ${ARGS[@]+"${ARGS[@]}"}
SIDE_BY_SIDE=(-n 2 --dist loadfile --no-loadscope-reorder)  # in the order tests/conftest.py gives
bash scripts/setup.sh test
.venv/bin/python -m ruff check .  # first: errors and likely bugs ([tool.ruff] in pyproject.toml) end it at once
if [ -n "$QUICK" ]; then
    echo "the quick tier: each test module's quick tests"
    .venv/bin/python -m pytest -q "${SIDE_BY_SIDE[@]}" -m quick tests "$@"
else
    echo "the unit tier: tests that start no process"
    .venv/bin/python -m pytest -q -m unit tests "$@"
    echo "the tests that start processes: workers, launchers, commands"
    .venv/bin/python -m pytest -q "${SIDE_BY_SIDE[@]}" -m "not unit" tests "$@"
fi
EQUIVALENCE="tests/test_equivalence.py tests/test_byo_model.py tests/test_byo_optimizer.py tests/test_exactness.py
    tests/test_loop.py tests/test_collate.py tests/test_prefetch.py tests/test_gather.py tests/test_word_lm.py
    tests/test_loss_probe.py tests/test_lightning_module.py tests/test_sn_backend.py"
# The kernels the runs above used: the best this CPU has (ATEN_CPU_CAPABILITY unset).
best=$(.venv/bin/python -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
for kernels in default avx2; do
    if [ "$kernels" = avx2 ] && [ "$best" = avx2 ]; then
        # An AVX2 machine's own kernels are AVX2's, C core and all: the runs above were this one.
        echo "equivalence tests with ATEN_CPU_CAPABILITY=avx2: already run above, this machine's best kernels are AVX2's"
        continue
    fi
    tier=${QUICK:+quick}
    [ "$kernels" = avx2 ] && [ -z "$QUICK" ] && tier="quick or contract"
    echo "equivalence tests with ATEN_CPU_CAPABILITY=$kernels${tier:+ (-m $tier)}"
    # With the portable kernels, the shared-memory collectives run their Python path too (no C core).
    native=1; [ "$kernels" = default ] && native=0
    ATEN_CPU_CAPABILITY=$kernels SN_TRAINER_NATIVE=$native .venv/bin/python -m pytest -q "${SIDE_BY_SIDE[@]}" ${tier:+-m "$tier"} \
        $EQUIVALENCE "$@"
done
