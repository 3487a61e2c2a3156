import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def cifar10_npz() -> Path | None:
    """The shared CIFAR-10 dev copy: $FEDSSL_CIFAR10_NPZ, or ../shared/data beside the checkout."""
    env = os.environ.get("FEDSSL_CIFAR10_NPZ")
    candidates = [Path(env)] if env else []
    candidates.append(REPO.parent / "shared" / "data" / "cifar10-dev.npz")
    for path in candidates:
        if path.is_file():
            return path.resolve()
    return None


@pytest.fixture(scope="session")
def cifar_npz() -> Path:
    path = cifar10_npz()
    if path is None:
        pytest.skip("CIFAR-10 dev npz not found (set FEDSSL_CIFAR10_NPZ or place ../shared/data/cifar10-dev.npz)")
    return path
