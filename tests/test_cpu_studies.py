"""The CPU-scale comparisons (configs/studies/cpu/): every row validates as the ServerApp would load it, and a row
differs from its base only where its name says."""

from __future__ import annotations

from conftest import study_experiments


def differences(a, b, prefix=""):
    """Dotted keys where two config dicts differ."""
    keys = set(a) | set(b)
    out = set()
    for k in keys:
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out |= differences(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.add(prefix + k)
    return out


def rows(name):
    return {v: c.to_dict() for v, c in study_experiments(f"cpu/{name}").items()}


def test_layerwise_rows_differ_only_in_strategy_and_fll_dd_in_its_method():
    r = rows("lwfedssl")
    assert {v: c["strategy"]["name"] for v, c in r.items()} == {
        "FedMoCoV3 (end to end)": "fedssl",
        "LW-FedSSL": "lwfedssl",
        "FedMoCo-LW": "fedmoco_lw",
        "Prog-FedSSL": "prog_fedssl",
        "FLL+DD (SimCLR)": "fll_dd",
        "centralized": "central",
    }
    base = r["LW-FedSSL"]
    for variant, cfg in r.items():
        allowed = {"name"} | {k for k in differences(base, cfg) if k.startswith("strategy.")}
        if variant == "FLL+DD (SimCLR)":
            allowed |= {k for k in differences(base, cfg) if k.startswith("method.")}
            assert cfg["method"]["name"] == "simclr" and cfg["method"]["options"]["proj_hidden_dim"] == 512
        assert differences(base, cfg) <= allowed, variant
        assert cfg["model"]["options"]["depth"] == 6 and cfg["rounds"] == 12  # every row ends with 6 blocks
        assert cfg["train"]["weight_decay"] == 1e-5
    assert r["FedMoCoV3 (end to end)"]["strategy"]["options"]["update_both"] is True
    assert r["LW-FedSSL"]["strategy"]["options"]["calibration_epochs"] is None  # = train.local_epochs (2)


def test_fedema_family_rows():
    r = rows("fedema-family")
    assert {v: c["strategy"]["name"] for v, c in r.items()} == {
        "FedBYOL": "fedssl",
        "FedU": "fedu",
        "FedEMA (autoscaler, tau 0.7, EasyFL divergence)": "fedema",
        "FedEMA (paper divergence)": "fedema",
        "centralized": "central",
        "L-DAWA (BYOL)": "ldawa",
        "FedX": "fedx",
        "Orchestra": "orchestra",
        "FedU2 (BYOL)": "fedu2",
    }
    assert r["FedEMA (autoscaler, tau 0.7, EasyFL divergence)"]["strategy"]["options"]["divergence"] == "easyfl"
    assert r["FedEMA (paper divergence)"]["strategy"]["options"]["divergence"] == "paper"
    assert r["FedU"]["strategy"]["options"]["threshold"] == 0.4
    own_objective = {"FedX": "fedx", "Orchestra": "orchestra"}  # methods whose local objective is their own
    for variant, cfg in r.items():
        allowed = {"name"} | {k for k in differences(r["FedBYOL"], cfg) if k.startswith("strategy.")}
        if variant == "Orchestra":  # its round 1 only seeds the centroids: one more round, the same 12 trained
            assert cfg["rounds"] == r["FedBYOL"]["rounds"] + 1 and cfg["strategy"]["options"]["seed_round"] is True
            allowed.add("rounds")
        if variant in own_objective:
            allowed |= {k for k in differences(r["FedBYOL"], cfg) if k.startswith("method.")}
            assert cfg["method"]["name"] == own_objective[variant]
        else:
            assert cfg["method"] == r["FedBYOL"]["method"], variant  # the same BYOL clients
        assert differences(r["FedBYOL"], cfg) <= allowed, variant
    # Orchestra's global clustering needs N_G <= 3 clients x N_L local centroids
    options = r["Orchestra"]["method"]["options"]
    assert options["num_global_clusters"] <= 3 * options["num_local_clusters"]


def test_flesd_rows_have_equal_local_compute():
    r = rows("flesd")
    flesd, fedavg = r["FLESD (T=2)"], r["FedAvg (SimCLR)"]
    assert flesd["rounds"] * flesd["train"]["local_epochs"] == fedavg["rounds"] * fedavg["train"]["local_epochs"] == 10
    assert r["centralized"]["strategy"]["name"] == "central" and r["centralized"]["rounds"] == 10


def test_heterossfl_rows_local_ssl_is_mu_0_and_centralized_per_architecture():
    r = rows("heterossfl")
    assert r["local SSL (mu 0)"]["strategy"]["options"]["mu"] == 0.0
    assert r["Hetero-SSFL (paper defaults)"]["strategy"]["options"]["mu"] == 0.5
    assert differences(r["local SSL (mu 0)"], r["Hetero-SSFL (paper defaults)"]) == {"name", "strategy.options.mu"}
    for arch in ("18", "34"):
        cfg = r[f"centralized ResNet-{arch}"]
        assert cfg["strategy"]["name"] == "central" and cfg["model"]["arch"] == f"resnet{arch}"
        assert cfg["model"]["client_archs"] == []
