"""The study file: one base experiment, the variants that differ from it, the seeds.

```yaml
study: fedema-family-cpu            # the study's name (default: the file's stem)
base: ../fedema/cpu-compare.yaml    # an experiment config, relative to this file (its own base chain applies)
seeds: [0, 1, 2]
overrides: {eval.max_test: 0}       # optional: applied to every variant
variants:                           # name -> overrides of the base (dotted keys or nested mappings)
  FedBYOL: {strategy.name: fedssl, strategy.options: null}
  FedU: {strategy: {name: fedu, options: {threshold: 0.4}}}
  centralized: {strategy.name: central, strategy.options: null}
```

A variant is merged over the base as ``base:`` chains are (``ssl_models.config.merge_config``: mappings merge,
other values replace, ``null`` restores the default). The random-init reference is part of every run; the
centralized row and any baseline are variants (a ``strategy: central`` variant is the report's centralized row).
``load_study`` checks everything before a run starts: the base exists, the seeds are integers, and every
(variant, seed) resolves to a valid experiment (unknown keys, wrong types, a strategy's options), each error one
line naming the variant and the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server_app.provenance import config_hash  # noqa: F401 - the reports' grouping key
from ssl_models.config import ConfigError, load_config_tree, merge_config, read_yaml_mapping

STUDY_KEYS = ("study", "base", "seeds", "overrides", "variants", "description")


@dataclass
class Study:
    name: str
    path: Path  # the study file
    base: Path  # the base experiment config (resolved)
    seeds: list[int]
    variants: dict[str, dict[str, Any]]  # name -> overrides, in the file's order
    overrides: dict[str, Any] = field(default_factory=dict)  # applied to every variant (file's, then the caller's)
    description: str = ""
    # every variant of the file, in its order, also when --variants narrowed ``variants`` (a report's row order)
    variant_order: list[str] = field(default_factory=list)
    # every seed of the file, also when --seeds narrowed ``seeds`` (what a report counts as not run yet)
    file_seeds: list[int] = field(default_factory=list)

    def runs(self) -> list[tuple[str, int]]:
        """Every (variant, seed), seed-major: a study stopped part-way has every variant of its first seeds."""
        return [(variant, seed) for seed in self.seeds for variant in self.variants]

    def experiment(self, variant: str, seed: int | None = None):
        """The validated ExperimentConfig of one run (the first seed by default), options' defaults filled in."""
        return validate_experiment(self.variant_tree(variant, self.seeds[0] if seed is None else seed))

    def variant_tree(self, variant: str, seed: int) -> dict[str, Any]:
        """The raw experiment config of one run (not validated): base, study overrides, the variant's, the seed
        and a name saying which run it is."""
        tree = merge_config(load_config_tree(self.base), self.overrides)
        tree = merge_config(tree, self.variants[variant])
        tree["seed"] = int(seed)
        tree["name"] = f"{self.name}-{slug(variant)}-seed{seed}"
        return tree


def run_folder_name(variant: str, seed: int) -> str:
    """The folder of one run of a study, under the study folder's ``runs/``."""
    return f"{slug(variant)}-seed{seed}"


def slug(text: str) -> str:
    """A variant's name as a folder name: "FedEMA (tau 0.7)" -> "fedema-tau-0.7"."""
    out = re.sub(r"[^a-z0-9.+]+", "-", text.lower()).strip("-")
    return out or "variant"


def _seeds(value: Any, where: str) -> list[int]:
    if (
        not isinstance(value, list)
        or not value
        or not all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    ):
        raise ConfigError(f"{where}: must be a non-empty list of integers (got {value!r})")
    if len(set(value)) != len(value):
        raise ConfigError(f"{where}: lists a seed twice ({value!r})")
    return list(value)


def load_study(
    path: str | Path,
    overrides: Mapping[str, Any] | None = None,
    *,
    seeds: list[int] | None = None,
    variants: list[str] | None = None,
    validate: bool = True,
) -> Study:
    """Read and check a study file. ``overrides`` (dotted keys, e.g. ``data.path``) apply to every variant after
    the study's own; ``seeds`` / ``variants`` narrow the study (names must exist). With ``validate`` every run's
    experiment config is resolved and validated as the ServerApp would (``validate_experiment``)."""
    path = Path(path).expanduser().resolve()
    raw = read_yaml_mapping(path, "study")
    unknown = sorted(set(raw) - set(STUDY_KEYS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown study key in {path.name} (valid: {', '.join(STUDY_KEYS)})")
    if "base" not in raw or not isinstance(raw["base"], str):
        raise ConfigError(f"base: a study names its base experiment config, relative to {path}")
    base = (path.parent / raw["base"]).resolve()
    if not base.is_file():
        raise ConfigError(f"base: {raw['base']!r} not found (resolved to {base}; named in {path})")
    study_variants = raw.get("variants")
    if not isinstance(study_variants, Mapping) or not study_variants:
        raise ConfigError(f"variants: a study lists at least one variant (name -> overrides) in {path.name}")
    parsed: dict[str, dict[str, Any]] = {}
    for name, changes in study_variants.items():
        if changes is None:
            changes = {}
        if not isinstance(changes, Mapping):
            raise ConfigError(f"variants.{name}: must be a mapping of overrides (got {changes!r})")
        parsed[str(name)] = dict(changes)
    slugs: dict[str, str] = {}
    for name in parsed:
        if slug(name) in slugs:
            raise ConfigError(f"variants.{name}: its folder name {slug(name)!r} is also {slugs[slug(name)]!r}'s")
        slugs[slug(name)] = name
    file_overrides = raw.get("overrides") or {}
    if not isinstance(file_overrides, Mapping):
        raise ConfigError(f"overrides: must be a mapping of overrides (got {file_overrides!r})")
    file_seeds = _seeds(raw.get("seeds", [0]), "seeds")
    study = Study(
        name=str(raw.get("study") or path.stem),
        path=path,
        base=base,
        seeds=list(file_seeds),
        variants=parsed,
        overrides=merge_config(file_overrides, overrides or {}),
        description=str(raw.get("description", "")),
        variant_order=list(parsed),
        file_seeds=file_seeds,
    )
    if seeds is not None:
        study.seeds = _seeds(list(seeds), "--seeds")
    if variants:
        missing = [v for v in variants if v not in study.variants]
        if missing:
            raise ConfigError(
                f"--variants: {missing[0]!r} is not a variant of {path.name} (variants: {', '.join(study.variants)})"
            )
        study.variants = {v: study.variants[v] for v in variants}
    if validate:
        for variant, seed in study.runs():
            try:
                validate_experiment(study.variant_tree(variant, seed))
            except ConfigError as exc:
                raise ConfigError(f"variants.{variant} (seed {seed}): {exc}") from None
    return study


def validate_experiment(tree: Mapping[str, Any]):
    """The ExperimentConfig of ``tree`` checked as the ServerApp checks one (types, values, architectures, the
    method's and the strategy's options, the strategy's own checks); returns it with the options' defaults filled."""
    from server_app.experiment import check_components
    from ssl_models.config import ExperimentConfig

    return check_components(ExperimentConfig.from_dict(tree))


def check_study_data(study: Study) -> int:
    """The data checks of every run (``ssl_models.data.preflight``: the data loads, splits and can be scored) made
    before the first run starts, once per distinct data, split and evaluation setting (the seed draws the split).
    Raises ConfigError naming the variant, its seed and the setting; returns the number of distinct checks made."""
    import json

    from ssl_models.data.preflight import check_experiment_data, data_is_local

    seen: set[str] = set()
    for variant, seed in study.runs():
        cfg = study.experiment(variant, seed)
        resolved = cfg.to_dict()
        key = json.dumps([resolved["data"], resolved["eval"], cfg.federation.num_clients, cfg.seed], sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        try:
            if data_is_local(cfg):
                check_experiment_data(cfg)
        except ConfigError as exc:
            raise ConfigError(f"variants.{variant} (seed {seed}): {exc}") from None
    return len(seen)
