"""Server-side Flower strategies; one module per strategy, registered here by config name."""

from __future__ import annotations

from .central import Central
from .fedema import FedEMA
from .fedprox import FedProx
from .fedssl import FedSSL
from .fedu import FedU
from .fedu2 import FedU2
from .fedx import FedX
from .flesd import FLESD
from .heterossfl import HeteroSSFL
from .layerwise import FLLDD, FedMoCoLW, LWFedSSL, ProgFedSSL
from .ldawa import LDAWA
from .local import Local
from .orchestra import Orchestra

STRATEGIES = {
    cls.name: cls
    for cls in (
        FedSSL,
        FedProx,
        FedEMA,
        FedU,
        FedU2,
        FedX,
        FLESD,
        Local,
        HeteroSSFL,
        Central,
        LWFedSSL,
        FedMoCoLW,
        ProgFedSSL,
        FLLDD,
        Orchestra,
        LDAWA,
    )
}


def get_strategy_class(name: str):
    try:
        return STRATEGIES[name]
    except KeyError:
        raise ValueError(f"strategy.name: unknown strategy {name!r} (valid: {', '.join(sorted(STRATEGIES))})") from None
