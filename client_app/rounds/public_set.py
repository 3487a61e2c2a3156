"""A client works on a public set (FLESD's, Hetero-SSFL's RAD) only when it is the server's: same images, same
order."""

from __future__ import annotations

import numpy as np

from ssl_models.data.splits import images_digest


class PublicSetMismatch(ValueError):
    """The client's public set is not the server's (different data, split or file)."""


def check_public_set(public: np.ndarray, expected_digest: str, partition_id: int, what: str = "public set") -> None:
    """Refuse to work on a public set (FLESD's, Hetero-SSFL's RAD) that is not the server's."""
    digest = images_digest(public)
    if digest != expected_digest:
        raise PublicSetMismatch(
            f"public set mismatch on client {partition_id}: its {len(public)} {what} images hash to {digest[:16]}, "
            f"the server's to {expected_digest[:16]}; both must load the same data file and config"
        )
