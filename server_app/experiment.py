"""Turn Flower's run config into a validated ExperimentConfig.

The run config holds ``config`` (a YAML file under ``configs/`` or any path), ``output-dir``, and one
key per YAML setting (``train.lr``, ``federation.num_clients``...) whose default in pyproject.toml is the
empty string, meaning "keep the YAML value". Any other value overrides the YAML.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ssl_models.config import ConfigError, ExperimentConfig, leaf_keys, validate_component_options
from ssl_models.methods import method_default_options
from ssl_models.networks import available_backbones
from strategies import get_strategy_class

APP_DIR = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/default.yaml"
# Run-config keys that are not YAML settings.
RUN_ONLY_KEYS = ("config", "output-dir", "resume")


def resolve_config_path(name: str) -> Path:
    """A config named relative to the app (``configs/x.yaml``) or the current directory, or absolute."""
    path = Path(name).expanduser()
    if path.is_absolute():
        return path
    for base in (APP_DIR, Path.cwd()):
        if (base / path).is_file():
            return base / path
    return APP_DIR / path


def option_run_keys() -> list[str]:
    """The run-config keys of the components' options: ``method.options.<name>`` for every option of every SSL
    method, ``strategy.options.<name>`` for every strategy's, ``model.options.<name>`` for every architecture's (all
    declared in pyproject.toml, so Flower accepts them; the chosen component then checks its own)."""
    from ssl_models.methods import METHODS
    from ssl_models.networks import ARCH_OPTIONS
    from strategies import STRATEGIES

    keys = {f"method.options.{k}" for cls in METHODS.values() for k in cls.default_options()}
    keys |= {f"strategy.options.{k}" for cls in STRATEGIES.values() for k in cls.default_options()}
    keys |= {f"model.options.{k}" for names in ARCH_OPTIONS.values() for k in names}
    return sorted(keys)


def overrides_from_run_config(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """The YAML settings the run config sets (its non-empty values), by dotted key."""
    known = set(leaf_keys()) | set(RUN_ONLY_KEYS) | set(option_run_keys())
    out = {}
    for key, value in run_config.items():
        if key in RUN_ONLY_KEYS or value == "":
            continue
        if key not in known:
            raise ConfigError(f"{key}: unknown run-config key (it is not a setting of the experiment config)")
        out[key] = value
    if run_config.get("output-dir", ""):
        out["output_dir"] = str(run_config["output-dir"])
    return out


def load_experiment(run_config: Mapping[str, Any]) -> tuple[ExperimentConfig, Path]:
    """Load, override, validate; check the data exists and component options are known."""
    given = str(run_config.get("config", "") or DEFAULT_CONFIG)
    path = resolve_config_path(given)
    if not path.is_file():
        raise ConfigError(
            f"config: {given!r} not found (looked for it in the app's folder and in {Path.cwd()}, the "
            "working directory of the SuperLink that runs the ServerApp); give an absolute path"
        )
    cfg = ExperimentConfig.from_yaml(path, overrides_from_run_config(run_config))
    cfg.check_files()
    check_components(cfg)
    if cfg.data.path:
        cfg.data.path = str(Path(cfg.data.path).expanduser().resolve())  # clients may run elsewhere
    return cfg, path


def check_components(cfg: ExperimentConfig) -> ExperimentConfig:
    """The checks that need the registries: the method's and the strategy's options (their defaults filled in),
    every architecture named, mixed architectures only where the strategy allows them, the strategy's own option and
    config checks. Raises ConfigError naming the key; returns ``cfg`` (changed in place)."""
    try:
        method_defaults = method_default_options(cfg.method.name)
    except ValueError as exc:
        raise ConfigError(f"method.name: {exc}") from None
    try:
        strategy_cls = get_strategy_class(cfg.strategy.name)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None  # the registry's message already names strategy.name
    cfg.method.options = validate_component_options(cfg.method.options, method_defaults, "method.options")
    valid_archs = available_backbones()
    for key, arch in (
        [("model.arch", cfg.model.arch)]
        + [("model.client_archs", a) for a in cfg.model.client_archs]
        + [("model.client_arch_pool", a) for a in cfg.model.client_arch_pool]
    ):
        if arch not in valid_archs:
            raise ConfigError(f"{key}: unknown architecture {arch!r} (valid: {', '.join(valid_archs)})")
    client_archs = [cfg.client_arch(i) for i in range(cfg.federation.num_clients)]
    if any(a != cfg.model.arch for a in client_archs) and not strategy_cls.supports_mixed_archs:
        raise ConfigError(
            f"model.client_archs: strategy {cfg.strategy.name!r} averages weights, so every client "
            f"must use model.arch ({cfg.model.arch!r}); mixed encoders need e.g. FLESD"
        )
    cfg.strategy.options = validate_component_options(
        cfg.strategy.options, strategy_cls.default_options(), "strategy.options"
    )
    try:
        strategy_cls.check_options(cfg.strategy.options)
        strategy_cls.check_config(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if cfg.logging.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError(
                "logging.tensorboard: the tensorboard package is not installed (pip install "
                "'fedssl[tensorboard]'), or set logging.tensorboard: false"
            ) from None
    return cfg


def output_dir_for(cfg: ExperimentConfig) -> Path:
    """``output_dir`` from the config/run config, else ``./outputs/<name>-<timestamp>``; absolute."""
    if cfg.output_dir:
        return Path(cfg.output_dir).expanduser().resolve()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return (Path.cwd() / "outputs" / f"{cfg.name}-{stamp}").resolve()
