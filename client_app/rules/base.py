"""What a client rule is, and the registry the ClientApp's training round looks rules up in.

A client rule decides how the received global weights enter the client's model (``download``), what the client
adds to its local objective (``loss_term``), what it uploads besides the shared weights (``upload_extra``) and what
it keeps until its next round (``keeps``). Every module of this package defines its rules and registers them with
``register``; the package imports them all, so a new strategy's client rule is one new module here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

ONLINE_ENCODER = ("backbone.", "projector.")
PREDICTOR = ("predictor.",)
META = "meta."

KEEPS = ("own", "model", "model_and_update")


@dataclass(frozen=True)
class ClientRule:
    """One client rule (the strategy names it by ``client_update``).

    - ``download(method, global_state, client_state, server_round, options, **rule_inputs) -> info``: load the
      round's start model into ``method``; ``info`` (numbers and flags) goes to the reply's ``rule.*`` metrics.
    - ``keeps``: ``"own"``: the client keeps what the server does not hold (target branch, MoCo queue);
      ``"model"``: its whole last model; ``"model_and_update"``: that, plus the size of this local update
      (``meta.update_size``, also reported) and a lambda the rule computed (``info["lambda"]``, FedEMA's).
    - ``loss_term(method, global_state, options, device) -> (method -> Tensor) | None``: a term added to every
      local step's loss (built once per round, after the download).
    - ``upload_extra(method, images, cfg, options, device, info) -> dict of arrays``: uploaded next to the shared
      weights, under names that start with the rule's own prefix (``"<name>."``), after local training.
    - ``replaces_training(method, images, cfg, options, device, *, server_round, seed) -> TrainStats | None``: a
      round the rule runs instead of local training (Orchestra's seeding round), returning its stats (steps 0
      where nothing trained); None: the round trains as usual.
    """

    name: str
    download: Callable[..., dict[str, Any]]
    keeps: str = "own"
    loss_term: Callable[..., Callable | None] | None = None
    upload_extra: Callable[..., dict[str, np.ndarray]] | None = None
    replaces_training: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        if self.keeps not in KEEPS:
            raise ValueError(f"client rule {self.name!r}: keeps must be one of {KEEPS} (got {self.keeps!r})")


RULES: dict[str, ClientRule] = {}


def register(rule: ClientRule) -> ClientRule:
    if rule.name in RULES:
        raise ValueError(f"client rule {rule.name!r} is registered twice")
    RULES[rule.name] = rule
    return rule


def get_rule(name: str) -> ClientRule:
    try:
        return RULES[name]
    except KeyError:
        raise ValueError(f"unknown client download rule {name!r} (valid: {', '.join(sorted(RULES))})") from None


def model_entries(state: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """The model entries of a client state (without ``meta.*``)."""
    return {k: v for k, v in (state or {}).items() if not k.startswith(META)}


def meta_value(state: Mapping[str, np.ndarray] | None, name: str, default: float | None = None) -> float | None:
    value = (state or {}).get(META + name)
    return default if value is None else float(np.asarray(value).reshape(-1)[0])


def pick(state: Mapping[str, np.ndarray], prefixes: tuple[str, ...]) -> dict[str, np.ndarray]:
    return {k: v for k, v in state.items() if k.startswith(prefixes)}
