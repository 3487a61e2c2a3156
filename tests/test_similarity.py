"""FLESD similarity matrices: top-k rounding, transport encodings, the ensemble and the distillation targets."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from ssl_models.federated.similarity import (
    decode_similarity,
    distillation_targets,
    encode_similarity,
    ensemble_similarity,
    index_dtype,
    pack_topk,
    payload_bytes,
    public_representations,
    similarity_matrix,
    similarity_topk,
    topk_count,
    topk_rows,
)

REPO = Path(__file__).resolve().parents[1]
e = math.exp

# Two clients' 3x3 "similarity" matrices. Every value is exact in float16, so transported payloads are
# exact too, and row maxima differ from 1 (row 1 of B is all negative) so the row-max shift matters.
A = [[0.5, 0.25, -0.5], [0.0, 1.0, 0.5], [-0.25, 0.75, 0.25]]
B = [[1.0, 0.0, 0.5], [-0.5, -0.25, -0.75], [0.25, 0.5, 0.75]]
TAU = 0.5
# exp((M - rowmax) / 0.5), written out by hand. Row maxima: A 0.5, 1.0, 0.75; B 1.0, -0.25, 0.75.
EXP_A = [[1.0, e(-0.5), e(-2.0)], [e(-2.0), 1.0, e(-1.0)], [e(-2.0), 1.0, e(-1.0)]]
EXP_B = [[1.0, e(-2.0), e(-1.0)], [e(-0.5), 1.0, e(-1.0)], [e(-1.0), e(-0.5), 1.0]]
# top-2 of 3 per row (fraction 0.34: floor(1.02) + 1 = 2). Dropped: A -0.5, 0.0, -0.25; B 0.0, -0.75, 0.25.
# paper: the dropped entry gets probability 0
PAPER_A = [[1.0, e(-0.5), 0.0], [0.0, 1.0, e(-1.0)], [0.0, 1.0, e(-1.0)]]
PAPER_B = [[1.0, 0.0, e(-1.0)], [e(-0.5), 1.0, 0.0], [0.0, e(-0.5), 1.0]]
# code: the dropped similarity becomes 0 before the exp, and the row max is taken over the zero-filled row:
# A rows keep their maxima (0.5, 1.0, 0.75) -> dropped entries exp(-0.5/0.5), exp(-1/0.5), exp(-0.75/0.5);
# B row 1 becomes [-0.5, -0.25, 0] with max 0 -> every entry shifts.
CODE_A = [[1.0, e(-0.5), e(-1.0)], [e(-2.0), 1.0, e(-1.0)], [e(-1.5), 1.0, e(-1.0)]]
CODE_B = [[1.0, e(-2.0), e(-1.0)], [e(-1.0), e(-0.5), 1.0], [e(-1.5), e(-0.5), 1.0]]


def _mean(x: list[list[float]], y: list[list[float]]) -> torch.Tensor:
    return (torch.tensor(x, dtype=torch.float64) + torch.tensor(y, dtype=torch.float64)) / 2


def _t(x: list[list[float]]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------- matrices
def test_similarity_matrix_is_cosine_of_rows() -> None:
    reps = torch.tensor([[3.0, 4.0], [0.0, 2.0], [-1.0, 0.0]])
    # unit rows: [.6, .8], [0, 1], [-1, 0]
    expected = torch.tensor([[1.0, 0.8, -0.6], [0.8, 1.0, 0.0], [-0.6, 0.0, 1.0]])
    matrix = similarity_matrix(reps)
    assert matrix.dtype == torch.float32
    torch.testing.assert_close(matrix, expected)
    with pytest.raises(ValueError, match="representations"):
        similarity_matrix(torch.ones(3))


@pytest.mark.parametrize(
    ("n", "fraction", "k"),
    [(10, 0.1, 2), (100, 0.29, 30), (3, 0.34, 2), (10000, 0.1, 1001), (7, 0.5, 4), (10, 1.0, 10), (1, 0.5, 1)],
)
def test_topk_count_is_floor_of_fraction_times_n_plus_self(n: int, fraction: float, k: int) -> None:
    assert topk_count(n, fraction) == k


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5, True])
def test_topk_count_rejects_fractions_outside_unit_interval(fraction: float) -> None:
    with pytest.raises(ValueError, match="fraction"):
        topk_count(10, fraction)


def test_topk_rows_keeps_largest_entries_sorted() -> None:
    values, indices = topk_rows(_t(A), 0.34)
    torch.testing.assert_close(values, _t([[0.5, 0.25], [1.0, 0.5], [0.75, 0.25]]))
    assert indices.tolist() == [[0, 1], [1, 2], [1, 2]]
    dense_values, dense_indices = topk_rows(_t(A), 1.0)
    assert dense_values.shape == (3, 3) and sorted(dense_indices[0].tolist()) == [0, 1, 2]


def test_chunked_similarity_topk_equals_topk_of_full_matrix() -> None:
    reps = torch.randn(53, 6, generator=torch.Generator().manual_seed(1))
    values, indices = similarity_topk(reps, 0.1, chunk_rows=7)
    ref_values, ref_indices = topk_rows(similarity_matrix(reps), 0.1)
    torch.testing.assert_close(values, ref_values)
    assert torch.equal(indices, ref_indices)
    assert torch.equal(indices[:, 0], torch.arange(53))  # the image itself is always the top entry
    # a client can pack the chunked top-k directly: same payload as encoding the full matrix
    packed = pack_topk(values, indices, 53)
    encoded = encode_similarity(similarity_matrix(reps), "topk", fraction=0.1)
    assert packed.keys() == encoded.keys()
    for name in packed:
        assert packed[name].dtype == encoded[name].dtype
        np.testing.assert_array_equal(packed[name], encoded[name])


# ---------------------------------------------------------------------------------------------- transport
@pytest.mark.parametrize(("n", "dtype"), [(256, np.uint8), (257, np.uint16), (65536, np.uint16), (65537, np.uint32)])
def test_index_dtype_is_smallest_unsigned_type_that_fits(n: int, dtype: type) -> None:
    assert index_dtype(n) == np.dtype(dtype)


def test_encodings_round_trip_and_byte_counts() -> None:
    n = 300
    matrix = similarity_matrix(torch.randn(n, 16, generator=torch.Generator().manual_seed(0)))

    fp32 = encode_similarity(matrix, "dense-fp32")
    assert payload_bytes(fp32) == 4 * n * n
    values, mask = decode_similarity(fp32, n)
    assert mask is None and torch.equal(values, matrix)

    fp16 = encode_similarity(matrix, "dense-fp16")
    assert payload_bytes(fp16) == 2 * n * n
    values, mask = decode_similarity(fp16, n)
    assert mask is None
    torch.testing.assert_close(values, matrix, atol=2**-11, rtol=0)  # float16 step in [0.5, 1] is 2^-11

    topk = encode_similarity(matrix, "topk", fraction=0.1)
    k = topk_count(n, 0.1)  # 31
    assert topk["values"].dtype == np.float16 and topk["indices"].dtype == np.uint16
    assert topk["values"].shape == topk["indices"].shape == (n, k)
    assert payload_bytes(topk) == k * n * (2 + 2)
    values, mask = decode_similarity(topk, n)
    assert mask.sum(dim=1).tolist() == [k] * n
    assert mask.diagonal().all()  # self-similarity (1, the row maximum) is always kept
    torch.testing.assert_close(values[mask], matrix[mask], atol=2**-11, rtol=0)
    assert torch.count_nonzero(values[~mask]) == 0
    # every dropped entry is smaller than or equal to every kept entry of its row
    kept_min = torch.where(mask, matrix, torch.inf).amin(dim=1)
    dropped_max = torch.where(mask, -torch.inf, matrix).amax(dim=1)
    assert bool((dropped_max <= kept_min).all())


def test_top_ten_percent_costs_about_ten_percent_of_dense_fp16_plus_indices() -> None:
    n = 1000
    matrix = similarity_matrix(torch.randn(n, 8, generator=torch.Generator().manual_seed(0)))
    topk = encode_similarity(matrix, "topk", fraction=0.1)
    dense_fp16 = payload_bytes(encode_similarity(matrix, "dense-fp16"))
    # 101 values of 2 bytes + 101 uint16 indices per row: 2 x 10.1 % of the dense fp16 matrix
    assert payload_bytes(topk) == 101 * n * 4
    assert topk["values"].nbytes / dense_fp16 == pytest.approx(0.101)
    assert payload_bytes(topk) / dense_fp16 == pytest.approx(0.202)


def test_encode_and_decode_reject_bad_arguments() -> None:
    matrix = _t(A)
    with pytest.raises(ValueError, match="mode"):
        encode_similarity(matrix, "sparse")
    with pytest.raises(ValueError, match="fraction is required"):
        encode_similarity(matrix, "topk")
    with pytest.raises(ValueError, match="only used with mode='topk'"):
        encode_similarity(matrix, "dense-fp16", fraction=0.5)
    with pytest.raises(ValueError, match="square"):
        encode_similarity(torch.ones(2, 3), "dense-fp32")
    with pytest.raises(ValueError, match="expected n=4"):
        decode_similarity(encode_similarity(matrix, "dense-fp32"), 4)
    bad = {"values": np.ones((3, 2), np.float16), "indices": np.array([[0, 1], [1, 2], [2, 3]], np.uint8)}
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        decode_similarity(bad, 3)


# ---------------------------------------------------------------------------------------------- ensemble
def test_dense_ensemble_matches_hand_computation() -> None:
    ensemble = ensemble_similarity([_t(A), _t(B).numpy()], TAU)
    assert ensemble.dtype == torch.float32
    torch.testing.assert_close(ensemble.double(), _mean(EXP_A, EXP_B), atol=1e-6, rtol=1e-6)


def test_sparse_ensemble_paper_and_code_variants_match_hand_computation() -> None:
    def payloads():
        return (encode_similarity(_t(m), "topk", fraction=0.34) for m in (A, B))

    paper = ensemble_similarity(payloads(), TAU, sparsify="zero_probability")
    code = ensemble_similarity(payloads(), TAU, sparsify="zero_similarity")
    torch.testing.assert_close(paper.double(), _mean(PAPER_A, PAPER_B), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(code.double(), _mean(CODE_A, CODE_B), atol=1e-6, rtol=1e-6)
    # the variants differ exactly on dropped entries (and on rows whose kept maximum is negative)
    assert not torch.allclose(paper, code)
    # the server can sparsify dense uploads itself (the official code's setting): same result
    for variant, expected in (("zero_probability", paper), ("zero_similarity", code)):
        server_side = ensemble_similarity([_t(A), _t(B)], TAU, sparsify=variant, keep_fraction=0.34)
        torch.testing.assert_close(server_side, expected)


def test_topk_with_fraction_one_equals_dense_ensemble_in_both_variants() -> None:
    payloads = [encode_similarity(_t(m), "topk", fraction=1.0) for m in (A, B)]
    for variant in ("zero_probability", "zero_similarity"):
        ensemble = ensemble_similarity(payloads, TAU, sparsify=variant)
        torch.testing.assert_close(ensemble.double(), _mean(EXP_A, EXP_B), atol=1e-6, rtol=1e-6)


def _naive_ensemble(matrices: list[torch.Tensor], masks: list[torch.Tensor | None], tau: float) -> torch.Tensor:
    """The textbook computation: a list of dense (N, N) probability matrices, averaged at the end."""
    probabilities = []
    for matrix, mask in zip(matrices, masks):
        row_max = (
            torch.where(mask, matrix, -torch.inf).amax(dim=1, keepdim=True)
            if mask is not None
            else (matrix.amax(dim=1, keepdim=True))
        )
        exp = torch.exp((matrix - row_max) / tau)
        probabilities.append(exp * mask if mask is not None else exp)
    return sum(probabilities) / len(probabilities)


def test_streaming_ensemble_of_2000_images_equals_naive_computation() -> None:
    n, tau = 2000, 0.1
    generator = torch.Generator().manual_seed(3)
    matrices = [similarity_matrix(torch.randn(n, 32, generator=generator)) for _ in range(3)]
    payloads = [
        encode_similarity(matrices[0], "topk", fraction=0.1),
        encode_similarity(matrices[1], "dense-fp16"),
        encode_similarity(matrices[2], "dense-fp32"),
    ]
    decoded = [decode_similarity(payload, n) for payload in payloads]
    expected = _naive_ensemble([values for values, _ in decoded], [mask for _, mask in decoded], tau)

    consumed = []

    def stream():  # a generator: the ensemble must not need the sources more than once
        for payload in payloads:
            consumed.append(True)
            yield payload

    # the naive reference masks dropped entries: the zero_probability variant
    ensemble = ensemble_similarity(stream(), tau, sparsify="zero_probability", chunk_rows=300)  # 300 ∤ 2000
    assert len(consumed) == 3
    torch.testing.assert_close(ensemble, expected, atol=1e-6, rtol=1e-5)


def test_ensemble_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ensemble_similarity([], TAU)
    with pytest.raises(ValueError, match="temperature"):
        ensemble_similarity([_t(A)], 0.0)
    with pytest.raises(ValueError, match="sparsify"):
        ensemble_similarity([_t(A)], TAU, sparsify="both")
    with pytest.raises(ValueError, match="expected n=3"):
        ensemble_similarity([_t(A), torch.eye(4)], TAU)
    with pytest.raises(ValueError, match="source"):
        ensemble_similarity([[1.0]], TAU)


# ---------------------------------------------------------------------------------------------- targets
def test_distillation_targets_renormalise_over_the_queue_by_hand() -> None:
    ensemble = torch.tensor([[4.0, 2.0, 2.0], [1.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    targets = distillation_targets(ensemble, torch.tensor([1, 2, 0]), torch.tensor([2, 0, 0]))
    # row 1 over columns (2, 0, 0): (0, 1, 1) / 2; row 2: (3, 0, 0) / 3; row 0: (2, 4, 4) / 10
    expected = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [0.2, 0.4, 0.4]])
    torch.testing.assert_close(targets, expected)


def test_distillation_targets_give_uniform_rows_when_the_queue_holds_only_zeros() -> None:
    ensemble = torch.tensor([[4.0, 2.0, 2.0], [1.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    targets = distillation_targets(ensemble, torch.tensor([1, 0]), torch.tensor([2, 2, 2, 2]))
    torch.testing.assert_close(targets, torch.tensor([[0.25] * 4, [0.25] * 4]))
    with pytest.raises(ValueError, match="queue_idx"):
        distillation_targets(ensemble, torch.tensor([0]), torch.tensor([3]))


# ---------------------------------------------------------------------------------------------- client side
def test_public_representations_are_the_projector_outputs_in_eval_mode() -> None:
    from ssl_models.methods import build_method
    from ssl_models.networks import build_backbone

    torch.manual_seed(0)
    backbone, dim = build_backbone("resnet18", width=0.125)
    method = build_method("simclr", backbone, dim, proj_hidden_dim=16, proj_out_dim=8)
    with torch.no_grad():  # BN running statistics away from (0, 1), so eval and train mode differ
        for module in method.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.uniform_(-0.2, 0.2)
                module.running_var.uniform_(0.5, 1.5)
    method.train()
    images = np.random.default_rng(0).integers(0, 256, size=(10, 16, 16, 3), dtype=np.uint8)
    reps = public_representations(method, images, batch_size=4)  # 4 + 4 + 2: batches are joined in order
    assert method.training and all(m.training for m in method.modules())  # the caller's mode is restored
    x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 255.0
    method.eval()
    with torch.no_grad():
        expected = method.projector(method.backbone(x))
        features = method.backbone(x)
    assert reps.shape == (10, 8) and reps.dtype == torch.float32
    torch.testing.assert_close(reps, expected, rtol=1e-5, atol=1e-6)
    assert features.shape == (10, dim) != reps.shape  # not the backbone features
    method.train()
    with torch.no_grad():
        in_train_mode = method.projector(method.backbone(x))
    assert not torch.allclose(reps, in_train_mode, atol=1e-3)  # and not batch statistics


# ---------------------------------------------------------------------------------------------- memory check
MEMORY_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    from ssl_models.federated.similarity import ensemble_similarity, pack_topk, payload_bytes, similarity_topk

    def status_bytes(key):
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
        return 0

    n, fraction = int(sys.argv[1]), 0.1
    generator = torch.Generator().manual_seed(0)
    payloads = [pack_topk(*similarity_topk(torch.randn(n, 128, generator=generator), fraction), n)
                for _ in range(2)]
    rss_before = status_bytes("VmRSS")
    try:  # reset the high-water mark to the current RSS, so only the ensemble's own peak is measured
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass
    start = time.perf_counter()
    ensemble = ensemble_similarity(iter(payloads), 0.1)
    seconds = time.perf_counter() - start
    peak = status_bytes("VmHWM")
    ok = bool(torch.isfinite(ensemble).all()) and bool((ensemble.diagonal() == 1).all())
    print(f"n={n} k={payloads[0]['values'].shape[1]} upload_MB={payload_bytes(payloads[0]) / 1e6:.1f} "
          f"ensemble_s={seconds:.2f} peak_MB={peak / 1e6:.0f} rss_before_MB={rss_before / 1e6:.0f} "
          f"peak_over_rss_in_N2_fp32={(peak - rss_before) / (4 * n * n):.2f} ok={ok}")
    """
)


def test_print_peak_memory_and_time_of_streaming_topk_ensemble() -> None:
    """Prints (run with -s) the ensemble's peak memory; FEDSSL_FLESD_MEMCHECK_N=10000 for the FLESD size.

    The numbers are informational; the test only checks that the run succeeded with a sane ensemble
    (every image is its own top entry in both clients, so the diagonal is exp(0) = 1).
    """
    n = int(os.environ.get("FEDSSL_FLESD_MEMCHECK_N", "2000"))
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(n)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    print("\n" + result.stdout.strip())
    assert "ok=True" in result.stdout
