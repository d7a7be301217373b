"""Command line: ``python -m sn_trainer key=value ...`` (Hydra). With cli/hydra_settings.py and
cli/hydra_callbacks.py, the only modules importing hydra."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from .cli import hydra_settings  # noqa: F401 - registers every setting's default before Hydra composes
from .cli.run_config import RunConfig, help_text
from .engine import forkserver
from .errors import InputError, TrainingDiverged, TrainingInterrupted, WorkerFailed


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    from .cli.job import run_job  # after Hydra parsed the command line: `--help` stays fast

    resolved = OmegaConf.to_container(cfg, resolve=True)
    try:
        hydra_cfg = HydraConfig.get()
        multirun = hydra_cfg.mode == RunMode.MULTIRUN
        summary = run_job(RunConfig.from_dict(resolved), hydra_cfg.runtime.output_dir, resolved,
                      sweep_dir=hydra_cfg.sweep.dir if multirun else None,
                      run_name=(hydra_cfg.job.override_dirname or f"job {hydra_cfg.job.num}") if multirun else None)
    except InputError as exc:
        _exit(2, f"error: {exc}")
    except TrainingInterrupted as exc:
        _exit(128 + exc.signum, f"interrupted: {exc}; resume with resume={exc.checkpoint}"
              if exc.checkpoint else f"interrupted: {exc}")
    except (WorkerFailed, TrainingDiverged, OSError) as exc:
        _exit(1, f"error: {exc}")
    except KeyboardInterrupt:
        _exit(130, "interrupted: stopped at once (second signal); no checkpoint of the current step")
    return summary.get("test_accuracy")


def _exit(code: int, message: str) -> None:
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def main() -> None:
    if any(arg in ("--help", "-h") for arg in sys.argv[1:]):
        print(help_text(_groups()))
        return
    refused = _refused_key(sys.argv[1:])
    if refused is not None:
        _exit(2, f"error: {refused}")
    if not any(arg.startswith(("start_method=", "allocator=", "openmp="))
               and not arg.endswith(("=forkserver", "=system", "=gnu")) for arg in sys.argv[1:]):
        # The warm workers' server imports torch now, while this process imports it too; a run
        # that asks for another start, allocator or OpenMP starts its own when its Trainer is made.
        forkserver.start()
    try:
        hydra_main()
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
        forkserver.leave(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1))
    forkserver.leave(0)


def _refused_key(args: list[str]) -> Exception | None:
    """The error for the first override of a key no setting has, or of a group's key that the
    group's chosen option does not read. Hydra answers ``batchsize=3`` with advice to write
    ``+batchsize=3``, which then fails again, and ``dataset.data_seed=3`` (with fashion_mnist)
    with advice to write ``+dataset.data_seed=3``, which sets a key nothing reads; this names the
    nearest key, or the options that have it."""
    if any(arg.startswith(("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")) for arg in args):
        return None  # a config of the user's own may have groups of its own
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from .cli.run_config import option_rows, unknown_setting

    known = {row[0] for row in option_rows()} | set(_groups())
    parser = OverridesParser.create()
    overrides = []
    for arg in args:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue  # a flag of Hydra's, or its value
        try:
            (override,) = parser.parse_overrides([arg])
        except Exception:  # noqa: BLE001 - a malformed override: Hydra says what is wrong with it
            continue
        if not (override.is_hydra_override() or override.package is not None or override.key_or_group in known):
            return unknown_setting(override.key_or_group)
        overrides.append(override)
    return _not_in_option(overrides)


def _not_in_option(overrides: list) -> Exception | None:
    """The error for the first key of a group (``dataset.data_seed``) that the option the group
    gets (``dataset=fashion_mnist``, the default, or an experiment's) does not list, in any job of
    a sweep. Each option's YAML lists every key that option reads: what it omits does nothing."""
    from .cli.run_config import not_in_option

    conf = Path(__file__).with_name("conf")
    options = {group: {path.stem: _names(path) for path in sorted((conf / group).glob("*.yaml"))}
               for group in RunConfig.SECTIONS if (conf / group).is_dir()}
    keys = [o.key_or_group.split(".", 1) for o in overrides if not o.is_delete() and "." in o.key_or_group]
    # A key every option has needs no composing (optim.lr, dataset.name).
    wanted = [(group, name) for group, name in keys
              if group in options and not all(name in names for names in options[group].values())]
    if not wanted or any(o.key_or_group == "hydra.searchpath" for o in overrides):
        return None  # nothing to check, or configs of the user's own
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # What chooses the options of these groups: group=option (each choice of a sweep), +experiment=...
    choosing = {group for group in _groups() if "/" not in group and group not in options} | {g for g, _ in wanted}
    try:
        choices = [[f"{o.get_key_element()}={value}" for value in o.sweep_string_iterator()] if o.is_sweep_override()
                   else [o.input_line] for o in overrides if o.key_or_group in choosing]
        with initialize_config_dir(str(conf), version_base="1.3"):
            for chosen in itertools.product(*choices):  # as Hydra composes each job: the default, an experiment's
                cfg = compose("config", overrides=list(chosen), return_hydra_config=True)
                for group, name in wanted:
                    if name not in cfg[group]:
                        option = cfg.hydra.runtime.choices[group]
                        return not_in_option(group, name, option, list(cfg[group]),
                                             [other for other, names in options[group].items() if name in names])
    except (HydraException, OmegaConfBaseException):
        return None  # an option that does not exist, a glob sweep: Hydra says what is wrong
    return None


def _names(path: Path) -> list[str]:
    """The keys a group option's YAML sets."""
    return [key for key in OmegaConf.load(path) if key != "defaults"]


def _groups() -> dict[str, list[str]]:
    conf = Path(__file__).with_name("conf")
    groups = [group for group in sorted(conf.iterdir()) if group.is_dir() and group.name != "hydra"]
    if (conf / "hydra").is_dir():  # hydra/launcher: Hydra's own groups (an installed wheel may ship none)
        groups += sorted(p for p in (conf / "hydra").iterdir() if p.is_dir())
    return {group.relative_to(conf).as_posix(): sorted(p.stem for p in group.glob("*.yaml")) for group in groups}


if __name__ == "__main__":
    main()
