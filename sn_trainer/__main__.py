"""Command line: ``python -m sn_trainer key=value ...`` (Hydra). The only module importing hydra."""
from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .config import ConfigError, RunConfig


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float | None:
    from .run import run  # after Hydra parsed the command line: `--help` stays fast

    resolved = OmegaConf.to_container(cfg, resolve=True)
    try:
        summary = run(RunConfig.from_dict(resolved), HydraConfig.get().runtime.output_dir, resolved)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    return summary.get("test_accuracy")


def main() -> None:
    hydra_main()


if __name__ == "__main__":
    main()
