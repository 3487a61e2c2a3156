"""The generalized FedSSL framework's client rules: FedSSL (and FedProx), FedEMA, FedU, Min-Local.

- ``fedssl``: the global online encoder (+ predictor) replaces the client's; the target branch is the client's own
  (first participation: a copy of the received online branch). ``update_both`` (the FedEMA paper's update-both):
  the target takes the global online weights too; ``aggregate_target`` (EasyFL's "aggregate the target too"): the
  target takes the received average of the clients' targets;
- ``fedema``: FedEMA's divergence-aware EMA of the client's last model with the global one (Algorithm 1);
- ``fedu``: FedU's divergence-aware predictor update;
- ``local``: Min-Local, no aggregation.
Per-client values the server sends with a round (``rule-input.<name>`` config keys, e.g. FedEMA's
server-computed ``server_lambda``) reach the rule as keyword arguments.
"""

from __future__ import annotations

from typing import Any

from ssl_models.factory import load_partial_state, reset_target_from_online
from ssl_models.federated.model_merge import autoscaler_lambda, ema_merge, fedema_mu, l2_divergence
from ssl_models.methods.base import TARGET_PREFIXES

from .base import ONLINE_ENCODER, PREDICTOR, ClientRule, register
from .base import meta_value as _meta
from .base import model_entries as _model_entries
from .base import pick as _pick


def fedssl_download(method, global_state, client_state, server_round, options) -> dict[str, Any]:
    """Generalized FedSSL: global online parts replace the client's; the rest stays the client's own.

    ``options["update_both"]``: the target branch takes the global online weights as well (the paper's
    update-both). With ``aggregate_target`` the server sends the averaged target, which is loaded as it is.
    A first participation without a received target starts the target as a copy of the global online branch.
    The MoCo queue is always the client's own."""
    own = _model_entries(client_state)
    if own:
        load_partial_state(method, own)
    load_partial_state(method, global_state)
    received_target = any(k.startswith(TARGET_PREFIXES) for k in global_state)
    if options.get("update_both", False) or (not own and not received_target):
        reset_target_from_online(method)
    return {}


def fedema_download(
    method, global_state, client_state, server_round, options, server_lambda: float | None = None
) -> dict[str, Any]:
    """FedEMA (Algorithm 1): W_k <- mu W_k + (1 - mu) W_g with mu = min(lambda ||W_g - W_k||, 1).

    A client seen for the first time, or not selected in the previous round, takes the global model for its
    online encoder, predictor **and target** (Algorithm 1, lines 13-14). Otherwise the online encoder and
    predictor take the EMA and the target stays the client's own. ``options``: mu_mode
    (autoscaler | lambda | constant), tau, lambda, mu_encoder, mu_predictor, ema_scope
    (both | encoder | predictor), divergence (paper | easyfl), lambda_from (server_first_round |
    client_first_ema), ema_bn_stats (global: BatchNorm running statistics take the global model's, the EMA moves
    parameters only, as the paper's W and EasyFL | ema: the statistics take the EMA too). ``server_lambda``: the autoscaler's lambda the server computed after this client's
    first training round (``lambda_from: server_first_round``); without it (``client_first_ema``, or a client
    whose first upload never reached the server) the client computes lambda = tau / d at its first EMA.
    """
    own = _model_entries(client_state)
    stored_lambda = _meta(client_state, "lambda")
    info: dict[str, Any] = {
        "ema": False,
        "mu": None,
        "mu_predictor": None,
        "divergence": None,
        "lambda": server_lambda if server_lambda is not None else stored_lambda,
        "lambda_from_server": server_lambda is not None,
    }
    if own:
        load_partial_state(method, own)
    last = _meta(client_state, "last_round")
    if not own or last is None or int(last) != server_round - 1:
        load_partial_state(method, global_state)
        reset_target_from_online(method)  # W_k^t <- W_g as well: a stale target would not match the new model
        info["reason"] = "first participation" if not own else "not selected in the previous round"
        return info
    d_paper = l2_divergence(global_state, own, ONLINE_ENCODER)
    d = d_paper if options["divergence"] == "paper" else _meta(client_state, "update_size", 0.0)
    lam = info["lambda"]
    if options["mu_mode"] == "autoscaler":
        from_server = (
            options.get("lambda_from", "server_first_round") == "server_first_round" and server_lambda is not None
        )
        lam = float(server_lambda) if from_server else stored_lambda
        if lam is None:  # once per client, at its first EMA update: its first mu is exactly tau
            lam = autoscaler_lambda(options["tau"], d)
        info["lambda_from_server"] = from_server
        mu_enc = mu_pred = fedema_mu(lam, d)
    elif options["mu_mode"] == "lambda":
        lam = float(options["lambda"])
        mu_enc = mu_pred = fedema_mu(lam, d)
    else:
        mu_enc, mu_pred = float(options["mu_encoder"]), float(options["mu_predictor"])
    scope = options["ema_scope"]
    merged = dict(global_state)  # parts outside the EMA scope take the global weights
    bn_stats = str(options.get("ema_bn_stats", "global"))
    if scope in ("both", "encoder"):
        merged.update(ema_merge(own, global_state, mu_enc, ONLINE_ENCODER, bn_stats))
    if scope in ("both", "predictor") and _pick(global_state, PREDICTOR):
        merged.update(ema_merge(own, global_state, mu_pred, PREDICTOR, bn_stats))
    load_partial_state(method, merged)
    info.update(ema=True, mu=mu_enc, mu_predictor=mu_pred, divergence=d, divergence_paper=d_paper, **{"lambda": lam})
    return info


def fedu_download(method, global_state, client_state, server_round, options) -> dict[str, Any]:
    """FedU: online encoder <- global; predictor <- global only if the divergence is below the threshold."""
    own = _model_entries(client_state)
    if own:
        load_partial_state(method, own)
    if not own:
        load_partial_state(method, global_state)
        reset_target_from_online(method)
        return {"divergence": None, "predictor_updated": True, "reason": "first participation"}
    d = (
        l2_divergence(global_state, own, ONLINE_ENCODER)
        if options["divergence"] == "paper"
        else _meta(client_state, "update_size", 0.0)
    )
    update_predictor = d < float(options["threshold"])
    incoming = {k: v for k, v in global_state.items() if update_predictor or not k.startswith(PREDICTOR)}
    load_partial_state(method, incoming)
    return {"divergence": d, "predictor_updated": bool(update_predictor)}


def local_download(method, global_state, client_state, server_round, options) -> dict[str, Any]:
    """Min-Local: no aggregation. The client starts once from the shared initial model, then only ever
    continues its own."""
    own = _model_entries(client_state)
    if own:
        load_partial_state(method, own)
        return {}
    load_partial_state(method, global_state)
    reset_target_from_online(method)
    return {}


register(ClientRule("fedssl", fedssl_download, keeps="own"))
register(ClientRule("local", local_download, keeps="model"))
register(ClientRule("fedema", fedema_download, keeps="model_and_update"))
register(ClientRule("fedu", fedu_download, keeps="model_and_update"))
