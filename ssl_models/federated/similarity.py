"""FLESD similarity matrices: computation, top-n% sparsification, transport encoding and the server ensemble.

FLESD (Federated Learning via Ensemble Similarity Distillation) clients upload, instead of weights, the
similarity matrix ``M = z z^T`` of their L2-normalised representations of a shared public set (N images).
The server turns every client matrix into unnormalised "probabilities" ``exp((M - rowmax) / tau_T)``,
averages them over clients and distils the average into the global model (see ``ssl_models.federated.distillation``).

Sparsification keeps the top-n% entries of each row plus the image itself:
``k = topk_count(N, fraction) = min(N, floor(fraction * N) + 1)`` (the official code's
``int(percent / 100 * N) + 1``; self-similarity is not counted as communication). The floor is taken after
rounding ``fraction * N`` to 9 decimals so that e.g. ``0.29 * 100 = 28.999999999999996`` counts as 29.

Two sparsification variants (``sparsify=``), named by what they do to a dropped entry:

- ``"zero_similarity"`` (default): the dropped *similarity* is set to 0 before the exp, so a dropped entry
  becomes ``exp((0 - rowmax) / tau_T)`` and the row maximum is taken over the zero-filled row. This is the
  paper's text ("substitute the discarded values with 0") and the official code;
- ``"zero_probability"``: a dropped entry gets probability **zero**, i.e. it is masked after the exp.

Transport (``encode_similarity``) is a dict of NumPy arrays, ready for a Flower ``ArrayRecord``:

==============  =======================================================  ====================
mode            arrays                                                   bytes
==============  =======================================================  ====================
``dense-fp32``  ``values`` float32 (N, N)                                4 N^2
``dense-fp16``  ``values`` float16 (N, N)                                2 N^2
``topk``        ``values`` float16 (N, k), ``indices`` uint8/16/32 (N, k) k N (2 + index bytes)
==============  =======================================================  ====================

The index dtype is the smallest unsigned type holding ``N - 1`` (uint8 up to N = 256, uint16 up to
N = 65,536, uint32 beyond). Cosine similarities lie in [-1, 1], where float16 has a resolution of at most
2^-11; after ``exp(. / 0.1)`` that is a relative error of at most ~0.5 %.

Memory: the ensemble is accumulated in place in one (N, N) float32 tensor, one client at a time and
``chunk_rows`` rows at a time, so sources may be a generator (the server can decode uploads one by one).
Peak memory is that accumulator plus one client's upload plus one row chunk.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, cast

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ssl_models.methods.base import SSLMethod

DENSE_FP32 = "dense-fp32"
DENSE_FP16 = "dense-fp16"
TOPK = "topk"
ENCODING_MODES: tuple[str, ...] = (DENSE_FP32, DENSE_FP16, TOPK)
ZERO_SIMILARITY = "zero_similarity"
ZERO_PROBABILITY = "zero_probability"
SPARSIFY_VARIANTS: tuple[str, ...] = (ZERO_SIMILARITY, ZERO_PROBABILITY)
DEFAULT_CHUNK_ROWS = 1024

# what ``ensemble_similarity`` accepts per client: a dense (N, N) matrix or an ``encode_similarity`` payload
SimilaritySource = torch.Tensor | np.ndarray | Mapping[str, np.ndarray]


# ------------------------------------------------------------------------------------------- checks
def _check_fraction(fraction: float) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
    return float(fraction)


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive number, got {temperature!r}")
    return float(temperature)


def _check_chunk_rows(chunk_rows: int) -> int:
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")
    return chunk_rows


def _check_square(name: str, shape: tuple[int, ...]) -> int:
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"{name} must be a square (N, N) matrix, got shape {tuple(shape)}")
    return int(shape[0])


# ------------------------------------------------------------------------------------------- matrices
def similarity_matrix(representations: torch.Tensor) -> torch.Tensor:
    """Cosine similarity matrix ``R R^T`` (float32, (N, N)) of the rows of ``representations`` (N, D).

    Rows are L2-normalised first, so the diagonal is 1 and every entry lies in [-1, 1]. Computed in float32
    with autocast off, so bf16 embeddings from an autocast region do not yield a bf16 matrix.
    """
    if representations.dim() != 2:
        raise ValueError(f"representations must be a 2-D (N, D) tensor, got shape {tuple(representations.shape)}")
    with torch.autocast(device_type=representations.device.type, enabled=False):
        rows = F.normalize(representations.float(), dim=1)
        return rows @ rows.t()


def topk_count(n: int, fraction: float) -> int:
    """Entries kept per row: ``min(n, floor(fraction * n) + 1)`` (the +1 is the image itself).

    ``fraction * n`` is rounded to 9 decimals before the floor, so floating-point noise does not lose an
    entry (``0.29 * 100`` is 28.999999999999996 in binary floating point).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    fraction = _check_fraction(fraction)
    return min(n, math.floor(round(fraction * n, 9)) + 1)


def topk_rows(matrix: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``topk_count(N, fraction)`` largest entries of each row of ``matrix`` (R, N).

    Returns ``(values (R, k), indices (R, k) int64)``, each row sorted in decreasing order. N is the number
    of columns, so a block of rows of a larger matrix is sparsified exactly as the whole matrix would be.
    ``fraction=1`` keeps every entry (k = N, i.e. dense). Ties at the cut-off are broken by ``torch.topk``
    (the official code keeps all tied entries instead; with continuous similarities ties do not occur).
    """
    if matrix.dim() != 2:
        raise ValueError(f"matrix must be a 2-D tensor, got shape {tuple(matrix.shape)}")
    k = topk_count(int(matrix.shape[1]), fraction)
    return torch.topk(matrix, k, dim=1, largest=True, sorted=True)


def similarity_topk(
    representations: torch.Tensor, fraction: float, chunk_rows: int = DEFAULT_CHUNK_ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk_rows(similarity_matrix(representations), fraction)`` without building the (N, N) matrix.

    Similarities are computed ``chunk_rows`` rows at a time, so a client with a large public set needs
    only (chunk_rows, N) floats of scratch space. Returns float32 values and int64 indices, (N, k).
    """
    if representations.dim() != 2:
        raise ValueError(f"representations must be a 2-D (N, D) tensor, got shape {tuple(representations.shape)}")
    chunk_rows = _check_chunk_rows(chunk_rows)
    n = int(representations.shape[0])
    k = topk_count(n, fraction)
    with torch.autocast(device_type=representations.device.type, enabled=False):
        rows = F.normalize(representations.float(), dim=1)
        values = torch.empty(n, k, dtype=torch.float32, device=rows.device)
        indices = torch.empty(n, k, dtype=torch.long, device=rows.device)
        for start in range(0, n, chunk_rows):
            stop = min(n, start + chunk_rows)
            values[start:stop], indices[start:stop] = torch.topk(rows[start:stop] @ rows.t(), k, dim=1)
    return values, indices


# ------------------------------------------------------------------------------------------- transport
def index_dtype(n: int) -> np.dtype:
    """Smallest unsigned integer dtype that holds every column index 0 .. n-1."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    for dtype in (np.uint8, np.uint16, np.uint32):
        if n - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def pack_topk(values: torch.Tensor, indices: torch.Tensor, n: int) -> dict[str, np.ndarray]:
    """``topk`` payload from ``(values, indices)`` rows: float16 values and the smallest index dtype for n."""
    if values.shape != indices.shape or values.dim() != 2:
        raise ValueError(
            f"values and indices must be 2-D with the same shape, got {tuple(values.shape)} and {tuple(indices.shape)}"
        )
    return {
        "values": values.detach().to("cpu", torch.float16).numpy(),
        "indices": indices.detach().cpu().numpy().astype(index_dtype(n)),
    }


def encode_similarity(matrix: torch.Tensor, mode: str, fraction: float | None = None) -> dict[str, np.ndarray]:
    """Transport form of a square similarity matrix (see the module docstring for modes and sizes).

    ``fraction`` is required by (and only allowed with) ``mode="topk"``.
    """
    if mode not in ENCODING_MODES:
        raise ValueError(f"mode must be one of {ENCODING_MODES}, got {mode!r}")
    n = _check_square("matrix", tuple(matrix.shape))
    if mode == TOPK:
        if fraction is None:
            raise ValueError("fraction is required when mode='topk'")
        values, indices = topk_rows(matrix, fraction)
        return pack_topk(values, indices, n)
    if fraction is not None:
        raise ValueError(f"fraction is only used with mode='topk', got fraction={fraction!r} with mode={mode!r}")
    dtype = np.float32 if mode == DENSE_FP32 else np.float16
    return {"values": matrix.detach().cpu().numpy().astype(dtype, copy=False)}


def payload_bytes(payload: Mapping[str, np.ndarray]) -> int:
    """Bytes on the wire: the sum of the arrays' ``nbytes`` (framing overhead excluded)."""
    return int(sum(np.asarray(array).nbytes for array in payload.values()))


def payload_kind(payload: Mapping[str, np.ndarray]) -> tuple[str, int]:
    """("dense" | "topk", N) of a similarity payload; ValueError if its keys or shapes are not a payload's."""
    return _payload_kind(payload, None)


def _payload_kind(payload: Mapping[str, np.ndarray], n: int | None) -> tuple[str, int]:
    """("dense" | "topk", N) of a payload, checking its arrays' shapes and keys."""
    keys = set(payload)
    if keys == {"values"}:
        return "dense", _check_square("payload['values']", tuple(np.shape(payload["values"])))
    if keys == {"values", "indices"}:
        values_shape, indices_shape = tuple(np.shape(payload["values"])), tuple(np.shape(payload["indices"]))
        if len(values_shape) != 2 or values_shape != indices_shape:
            raise ValueError(
                f"payload 'values' and 'indices' must be 2-D with the same shape, got {values_shape} and "
                f"{indices_shape}"
            )
        rows = values_shape[0]
        if values_shape[1] > rows:
            raise ValueError(f"payload keeps {values_shape[1]} entries per row but has only {rows} rows")
        return "topk", rows
    raise ValueError(f"payload must hold 'values' (dense) or 'values' and 'indices' (topk), got keys {sorted(keys)}")


def _check_n(kind_n: int, n: int | None, what: str) -> int:
    if n is not None and kind_n != n:
        raise ValueError(f"{what} describes a {kind_n}x{kind_n} matrix, expected n={n}")
    return kind_n


def decode_similarity(payload: Mapping[str, np.ndarray], n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense float32 (n, n) values and, for ``topk`` payloads, the bool mask of kept entries (else None).

    Dropped entries are 0 in the values; the mask tells them apart from kept zeros.
    """
    kind, rows = _payload_kind(payload, n)
    _check_n(rows, n, "payload")
    values = torch.from_numpy(np.asarray(payload["values"], dtype=np.float32))
    if kind == "dense":
        return values, None
    indices = _indices_tensor(payload["indices"], n)
    dense = torch.zeros(n, n, dtype=torch.float32).scatter_(1, indices, values)
    mask = torch.zeros(n, n, dtype=torch.bool).scatter_(1, indices, True)
    return dense, mask


def _indices_tensor(indices: np.ndarray, n: int) -> torch.Tensor:
    """int64 tensor of transported column indices, checked to lie in [0, n)."""
    result = torch.from_numpy(np.asarray(indices).astype(np.int64))
    if result.numel() and (int(result.min()) < 0 or int(result.max()) >= n):
        raise ValueError(f"payload indices must lie in [0, {n}), got range [{int(result.min())}, {int(result.max())}]")
    return result


# ------------------------------------------------------------------------------------------- ensemble
class _RowSource:
    """Read access to one client's matrix in row blocks: dense rows, or sparse ``(values, indices)`` rows."""

    values: np.ndarray | torch.Tensor  # a dense source as given; a payload's values (an array)
    indices: np.ndarray | None  # a top-k payload's column indices

    def __init__(self, source: SimilaritySource, n: int | None) -> None:
        if isinstance(source, Mapping):
            self.kind, self.n = _payload_kind(source, n)
            _check_n(self.n, n, "every source")
            self.values = np.asarray(source["values"])
            self.indices = np.asarray(source["indices"]) if self.kind == "topk" else None
        elif isinstance(source, (torch.Tensor, np.ndarray)):
            self.kind = "dense"
            self.n = _check_n(_check_square("a dense source", tuple(source.shape)), n, "every source")
            self.values = source
            self.indices = None
        else:
            raise ValueError(  # noqa: TRY004 - bad input is a ValueError here, like the checks above
                "each source must be a torch.Tensor, numpy array or encode_similarity payload, got "
                f"{type(source).__name__}"
            )
        if self.indices is not None and self.indices.size and (self.indices.min() < 0 or self.indices.max() >= self.n):
            raise ValueError(f"payload indices must lie in [0, {self.n})")

    def dense_rows(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """A float32 copy of rows [start, stop) (safe to modify in place)."""
        block = self.values[start:stop]
        if isinstance(block, np.ndarray):
            block = torch.from_numpy(block)
        return block.to(device=device, dtype=torch.float32, copy=True)

    def sparse_rows(self, start: int, stop: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 values (a copy, safe to modify in place) and int64 indices of rows [start, stop)."""
        # a payload's rows: values and indices are arrays (kind "topk")
        values = torch.from_numpy(cast(np.ndarray, self.values)[start:stop].astype(np.float32)).to(device)
        indices = torch.from_numpy(cast(np.ndarray, self.indices)[start:stop].astype(np.int64)).to(device)
        return values, indices


def _add_dense_rows_(out_rows: torch.Tensor, rows: torch.Tensor, temperature: float) -> None:
    """``out_rows += exp((rows - rowmax) / T)``, consuming ``rows`` as scratch space."""
    rows.sub_(rows.amax(dim=1, keepdim=True)).div_(temperature).exp_()
    out_rows.add_(rows)


def _add_sparse_rows_(
    out_rows: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, temperature: float, sparsify: str
) -> None:
    """Add one block of top-k rows to the accumulator, dropped entries handled per ``sparsify``."""
    n = out_rows.shape[1]
    has_dropped = values.shape[1] < n
    row_max = values.amax(dim=1, keepdim=True)
    if sparsify == ZERO_SIMILARITY and has_dropped:
        row_max = row_max.clamp_min(0.0)  # the zero-filled dropped entries take part in the row max
    kept = values.sub_(row_max).div_(temperature).exp_()
    if sparsify == ZERO_PROBABILITY or not has_dropped:
        out_rows.scatter_add_(1, indices, kept)  # dropped entries: probability 0, nothing to add
        return
    dropped = torch.exp(-row_max / temperature)  # exp((0 - rowmax) / T) for every dropped entry
    block = dropped.expand(-1, n).clone().scatter_(1, indices, kept)
    out_rows.add_(block)


def ensemble_similarity(
    sources: Iterable[SimilaritySource],
    temperature: float,
    *,
    sparsify: str = ZERO_SIMILARITY,
    keep_fraction: float | None = None,
    n: int | None = None,
    chunk_rows: int = DEFAULT_CHUNK_ROWS,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """FLESD ensemble target: the mean over clients of ``exp((M_c - rowmax(M_c)) / temperature)``, unnormalised.

    ``sources`` yields, per client, a dense (N, N) similarity matrix (tensor or array) or an
    ``encode_similarity`` payload; it may be a generator, consumed once, so uploads can be decoded one at a
    time. ``topk`` payloads are sparsified per ``sparsify`` ("zero_similarity": dropped similarities are 0
    before the exp; "zero_probability": dropped entries get probability 0). ``keep_fraction`` additionally
    sparsifies dense sources on the server (the official code's setting, where the server forms M itself); payloads that
    are already top-k are used as sent. Rows are NOT renormalised: ``distillation_targets`` renormalises
    over the queue entries of each batch.

    Returns a float32 (N, N) tensor on ``device``. Work happens in place, ``chunk_rows`` rows at a time.
    """
    temperature = _check_temperature(temperature)
    if sparsify not in SPARSIFY_VARIANTS:
        raise ValueError(f"sparsify must be one of {SPARSIFY_VARIANTS}, got {sparsify!r}")
    if keep_fraction is not None:
        _check_fraction(keep_fraction)
    chunk_rows = _check_chunk_rows(chunk_rows)
    device = torch.device(device)

    out: torch.Tensor | None = None
    num_sources = 0
    for source in sources:
        rows = _RowSource(source, n)
        n = rows.n
        if out is None:
            out = torch.zeros(n, n, dtype=torch.float32, device=device)
        _accumulate_source_(out, rows, temperature, sparsify, keep_fraction, chunk_rows)
        num_sources += 1
        del rows, source  # let a streamed upload be freed before the next one is decoded
    if out is None:
        raise ValueError("sources must contain at least one similarity matrix or payload")
    return out.div_(num_sources)


def _accumulate_source_(
    out: torch.Tensor,
    rows: _RowSource,
    temperature: float,
    sparsify: str,
    keep_fraction: float | None,
    chunk_rows: int,
) -> None:
    """Add one client's exp-transformed matrix to ``out``, block of rows by block of rows."""
    n = rows.n
    server_topk = rows.kind == "dense" and keep_fraction is not None and topk_count(n, keep_fraction) < n
    with torch.autocast(device_type=out.device.type, enabled=False):
        for start in range(0, n, chunk_rows):
            stop = min(n, start + chunk_rows)
            out_rows = out[start:stop]
            if rows.kind == "topk":
                values, indices = rows.sparse_rows(start, stop, out.device)
                _add_sparse_rows_(out_rows, values, indices, temperature, sparsify)
            elif server_topk:
                values, indices = topk_rows(rows.dense_rows(start, stop, out.device), keep_fraction)  # type: ignore[arg-type]  # server_topk: set
                _add_sparse_rows_(out_rows, values, indices, temperature, sparsify)
            else:
                _add_dense_rows_(out_rows, rows.dense_rows(start, stop, out.device), temperature)


# ------------------------------------------------------------------------------------------- targets
def distillation_targets(ensemble: torch.Tensor, batch_idx: torch.Tensor, queue_idx: torch.Tensor) -> torch.Tensor:
    """Soft targets ``S[batch_idx][:, queue_idx]``, each row renormalised to sum 1 (float32, (B, K)).

    A row whose entries over the queue are all zero (possible with ``sparsify: zero_probability`` when no queue
    image is among the row's kept entries; FLESD's own enqueue-before-logits order puts the query's own
    image, whose similarity is never dropped, in the queue) gets the uniform distribution 1/K instead of
    NaN. The result is on ``ensemble``'s device.
    """
    if ensemble.dim() != 2 or ensemble.shape[0] != ensemble.shape[1]:
        raise ValueError(f"ensemble must be a square (N, N) matrix, got shape {tuple(ensemble.shape)}")
    if batch_idx.dim() != 1 or queue_idx.dim() != 1:
        raise ValueError(
            f"batch_idx and queue_idx must be 1-D, got shapes {tuple(batch_idx.shape)} and {tuple(queue_idx.shape)}"
        )
    n = ensemble.shape[0]
    batch_idx = batch_idx.to(ensemble.device, torch.long)
    queue_idx = queue_idx.to(ensemble.device, torch.long)
    for name, idx in (("batch_idx", batch_idx), ("queue_idx", queue_idx)):
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"{name} must lie in [0, {n}), got range [{int(idx.min())}, {int(idx.max())}]")
    block = ensemble.index_select(0, batch_idx).index_select(1, queue_idx).float()
    sums = block.sum(dim=1, keepdim=True)
    uniform = torch.full_like(block, 1.0 / max(1, block.shape[1]))
    return torch.where(sums > 0, block / sums.clamp_min(torch.finfo(block.dtype).tiny), uniform)


# ------------------------------------------------------------------------------------------- client side
@torch.no_grad()
def public_representations(
    method: SSLMethod, images_uint8_nhwc: np.ndarray, device: torch.device | str = "cpu", batch_size: int = 512
) -> torch.Tensor:
    """Projector outputs ``projector(backbone(x))`` of the public images, eval mode, no augmentation, float32 on
    the CPU (FLESD's representations: the contrastive head's output). The module's modes are restored."""
    from ssl_models.data.augment import to_float_nchw

    modes = {m: m.training for m in method.modules()}
    method.eval()
    method.to(device)
    out = []
    try:
        for start in range(0, len(images_uint8_nhwc), batch_size):
            x = to_float_nchw(images_uint8_nhwc[start : start + batch_size]).to(device).contiguous()
            out.append(method.projector(method.backbone(x)).float().cpu())
    finally:
        for module, mode in modes.items():
            module.train(mode)
    return torch.cat(out) if out else torch.zeros(0, 0)


def client_similarity_payload(
    representations: torch.Tensor, mode: str, fraction: float | None = None
) -> dict[str, np.ndarray]:
    """What a FLESD client uploads: the similarity matrix of its representations in transport form. The
    top-n% form is computed row-block by row-block, never holding the (N, N) matrix."""
    if mode == TOPK:
        values, indices = similarity_topk(representations, fraction)  # type: ignore[arg-type]  # None: a ValueError
        return pack_topk(values, indices, int(representations.shape[0]))
    return encode_similarity(similarity_matrix(representations), mode)
