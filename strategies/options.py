"""Value checks for strategy options; each error names ``strategy.options.<key>``."""

from __future__ import annotations

from typing import Any


def check_choice(options: dict[str, Any], key: str, choices: tuple[str, ...]) -> None:
    if options[key] not in choices:
        raise ValueError(f"strategy.options.{key}: must be one of {', '.join(choices)} (got {options[key]!r})")


def check_positive(options: dict[str, Any], key: str) -> None:
    if not options[key] > 0:
        raise ValueError(f"strategy.options.{key}: must be > 0 (got {options[key]!r})")


def check_unit(options: dict[str, Any], key: str) -> None:
    if not 0.0 <= options[key] <= 1.0:
        raise ValueError(f"strategy.options.{key}: must be in [0, 1] (got {options[key]!r})")


def check_bool(options: dict[str, Any], key: str) -> None:
    if not isinstance(options[key], bool):
        raise ValueError(  # noqa: TRY004 - a config error: the loader reports ValueErrors
            f"strategy.options.{key}: must be true or false (got {options[key]!r})"
        )
