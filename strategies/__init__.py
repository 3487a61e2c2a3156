"""Server-side Flower strategies; one module per strategy, registered here by config name."""

from __future__ import annotations

from .central import Central
from .fedema import FedEMA
from .fedprox import FedProx
from .fedssl import FedSSL
from .fedu import FedU
from .flesd import FLESD
from .heterossfl import HeteroSSFL
from .layerwise import FLLDD, FedMoCoLW, LWFedSSL, ProgFedSSL
from .local import Local

STRATEGIES = {
    cls.name: cls
    for cls in (
        FedSSL,
        FedProx,
        FedEMA,
        FedU,
        FLESD,
        Local,
        HeteroSSFL,
        Central,
        LWFedSSL,
        FedMoCoLW,
        ProgFedSSL,
        FLLDD,
    )
}


def get_strategy_class(name: str):
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"strategy.name: unknown strategy {name!r} (valid: {', '.join(sorted(STRATEGIES))})") from None
