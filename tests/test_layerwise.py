"""Layer-wise FedSSL (LW-FedSSL, FedMoCo-LW, Prog-FedSSL, FLL+DD): the stage schedule, learning rates, growth and
freezing, the bytes of every message kind counted by hand, the alignment loss against a hand computation, the
server-side calibration, downloads for clients that missed stages, option errors, configs."""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from flwr.app import ConfigRecord, Error, Message, MetricRecord, RecordDict

from client_app.rounds.layerwise import layerwise_round
from client_app.rounds.weights import train_local_ssl
from client_app.rules.fedssl_family import fedssl_download
from conftest import NodeGrid, experiment_config_files, study_experiments
from fedssl_wire import LAYERWISE_MESSAGE_TYPE, from_array_record, to_array_record
from server_app.experiment import load_experiment
from ssl_models.config import ConfigError, set_dotted
from ssl_models.data.splits import client_images, federated_split, load_experiment_data, public_images
from ssl_models.evaluation.checkpoint import load_encoder_checkpoint, save_encoder_checkpoint
from ssl_models.factory import build_ssl_model, split_state, state_to_numpy
from ssl_models.federated.layerwise import (
    RepresentationAligner,
    alignment_loss,
    build_layerwise_model,
    calibrate,
    configure_local_model,
    grow_online_state,
    online_state,
    round_lr,
    select,
    stage_of_round,
    stage_rounds,
    submodel_prefixes,
    trained_prefixes,
)
from ssl_models.methods.base import TARGET_PREFIXES
from strategies import get_strategy_class
from strategies.fedssl import ModelToEvaluate
from strategies.layerwise import FLLDD, FedMoCoLW, LWFedSSL, ProgFedSSL, entry_bytes
from wire_bytes import hand_bytes, raw_bytes

REPO = Path(__file__).resolve().parents[1]
SMOKE = "configs/smoke-lwfedssl.yaml"


pytestmark = pytest.mark.usefixtures("task_identity")  # messages are built outside a run


def experiment(variant: str = "lwfedssl", **overrides):
    run_config = {
        "config": SMOKE,
        "data.dataset": "synthetic",
        "data.synthetic_train": 300,
        "strategy.name": variant,
        **overrides,
    }
    return load_experiment(run_config)[0]


# ---------------------------------------------------------------------- schedule and learning rates


@pytest.mark.parametrize(("rounds", "stages"), [(180, 12), (24, 12), (12, 12), (100, 7), (10, 3)])
def test_allocations_sum_to_the_rounds_and_have_their_shape(rounds, stages):
    uniform = stage_rounds(rounds, stages, "uniform")
    right = stage_rounds(rounds, stages, "right_skewed")
    left = stage_rounds(rounds, stages, "left_skewed")
    for counts in (uniform, right, left):
        assert sum(counts) == rounds and len(counts) == stages and min(counts) >= 1
    assert max(uniform) - min(uniform) <= 1
    assert all(a >= b for a, b in itertools.pairwise(right))  # most rounds early, the tail to the right
    assert all(a <= b for a, b in itertools.pairwise(left))
    if rounds > 2 * stages:
        assert right[0] > right[-1] and left[-1] > left[0]


def test_paper_schedule_and_stage_of_round():
    assert stage_rounds(180, 12, "uniform") == [15] * 12
    assert stage_rounds(10, 3, "uniform") == [4, 3, 3]
    # 1 + the 168 spare rounds by weights 12..1 (largest remainder): 27 .. 3
    assert stage_rounds(180, 12, "right_skewed") == [27, 25, 23, 20, 18, 16, 14, 12, 10, 7, 5, 3]
    assert stage_rounds(180, 12, "left_skewed") == [3, 5, 7, 10, 12, 14, 16, 18, 20, 23, 25, 27]
    counts = [2, 3, 1]
    stages = [stage_of_round(r, counts) for r in range(1, 7)]
    assert [p.stage for p in stages] == [1, 1, 2, 2, 2, 3]
    assert [p.round_in_stage for p in stages] == [1, 2, 1, 2, 3, 1]
    assert [p.is_stage_start for p in stages] == [True, False, True, False, False, True]
    assert stages[3].progress == (3 / 6, 4 / 6)
    with pytest.raises(ValueError, match="cannot hold 13 stages"):
        stage_rounds(12, 13)
    with pytest.raises(ValueError, match="beyond the schedule"):
        stage_of_round(7, counts)
    with pytest.raises(ValueError, match="allocation must be one of"):
        stage_rounds(12, 3, "skewed")


def test_learning_rate_strategies():
    counts = [2, 3]
    base = 0.4
    assert [round_lr(base, r, counts, "fixed") for r in range(1, 6)] == [base] * 5
    cosine = [base * 0.5 * (1 + math.cos(math.pi * (r - 1) / 5)) for r in range(1, 6)]
    assert [round_lr(base, r, counts, "cosine") for r in range(1, 6)] == pytest.approx(cosine)
    # cyclic: a cosine within each stage, restarting at every stage start
    cyclic = [base, base * 0.5, base, base * 0.75, base * 0.25]
    assert [round_lr(base, r, counts, "cyclic") for r in range(1, 6)] == pytest.approx(cyclic)
    cfg = experiment(**{"train.lr_schedule": "cosine"})
    assert [round_lr(cfg.train.lr, r, [2, 2, 2], "cosine") for r in range(1, 7)] == pytest.approx(
        [cfg.round_lr(r) for r in range(1, 7)]
    )  # the run-config cosine, unchanged


# ---------------------------------------------------------------------- what belongs to what; growth and freezing


def test_key_ownership():
    keys = [
        "backbone.cls_token",
        "backbone.pos_embed",
        "backbone.patch_embed.weight",
        "backbone.patch_embed.bias",
        *(f"backbone.blocks.{i}.mlp.fc1.weight" for i in range(11)),
        "backbone.norm.weight",
        "projector.0.weight",
        "predictor.0.weight",
        "target_backbone.blocks.0.mlp.fc1.weight",
        "target_projector.0.weight",
    ]
    state = {k: None for k in keys}
    heads = ("projector.", "predictor.")
    stage1 = list(select(state, trained_prefixes(1, "last_block", heads)))
    assert stage1 == keys[:4] + [
        "backbone.blocks.0.mlp.fc1.weight",
        "backbone.norm.weight",
        "projector.0.weight",
        "predictor.0.weight",
    ]
    stage2 = list(select(state, trained_prefixes(2, "last_block", heads)))  # blocks.1 is not blocks.10
    assert stage2 == [
        "backbone.blocks.1.mlp.fc1.weight",
        "backbone.norm.weight",
        "projector.0.weight",
        "predictor.0.weight",
    ]
    assert list(select(state, trained_prefixes(2, "all", heads))) == list(select(state, submodel_prefixes(2, heads)))
    assert list(select(state, submodel_prefixes(2, heads))) == keys[:6] + [
        "backbone.norm.weight",
        "projector.0.weight",
        "predictor.0.weight",
    ]


def test_growth_copies_or_initialises_the_new_block_and_leaves_the_rest():
    cfg = experiment()
    method = build_layerwise_model(cfg, 2, seed=3)
    state = online_state(method)
    copied = grow_online_state(cfg, state, "copy", seed=5)
    assert list(copied) == list(online_state(build_layerwise_model(cfg, 3, seed=0)))
    for key, value in state.items():
        np.testing.assert_array_equal(copied[key], value)
    for key in (k for k in copied if k.startswith("backbone.blocks.2.")):
        np.testing.assert_array_equal(copied[key], state[key.replace("blocks.2.", "blocks.1.")])
    fresh = grow_online_state(cfg, state, "fresh", seed=5)
    assert not np.array_equal(fresh["backbone.blocks.2.attn.qkv.weight"], state["backbone.blocks.1.attn.qkv.weight"])
    again = grow_online_state(cfg, state, "fresh", seed=5)
    np.testing.assert_array_equal(
        again["backbone.blocks.2.attn.qkv.weight"], fresh["backbone.blocks.2.attn.qkv.weight"]
    )


def gradient_owners(method) -> set[str]:
    v1, v2 = torch.rand(4, 3, 32, 32), torch.rand(4, 3, 32, 32)
    method.train()
    method.training_step(v1, v2).backward()
    owners = set()
    for name, p in method.named_parameters():
        if p.grad is not None and p.grad.abs().sum() > 0:
            parts = name.split(".")
            owners.add(".".join(parts[:3]) if parts[1] == "blocks" else ".".join(parts[:2]))
    return owners


def test_layerwise_freezes_all_but_the_active_block_and_prog_trains_everything():
    cfg = experiment()
    method = build_layerwise_model(cfg, 3, seed=0)
    configure_local_model(method, "last_block")
    owners = gradient_owners(method)
    assert {o for o in owners if o.startswith("backbone.")} == {"backbone.blocks.2", "backbone.norm"}
    assert {o.split(".")[0] for o in owners} == {"backbone", "projector", "predictor"}  # never the target
    assert [p.requires_grad for p in method.backbone.blocks[0].parameters()] == [False] * 12
    stage1 = build_layerwise_model(cfg, 1, seed=0)
    configure_local_model(stage1, "last_block")
    assert {o for o in gradient_owners(stage1) if o.startswith("backbone.")} == {
        "backbone.patch_embed",
        "backbone.cls_token",
        "backbone.pos_embed",
        "backbone.blocks.0",
        "backbone.norm",
    }
    prog = build_layerwise_model(cfg, 3, seed=0)
    configure_local_model(prog, "all")
    assert {o for o in gradient_owners(prog) if o.startswith("backbone.")} == {
        "backbone.patch_embed",
        "backbone.cls_token",
        "backbone.pos_embed",
        "backbone.blocks.0",
        "backbone.blocks.1",
        "backbone.blocks.2",
        "backbone.norm",
    }
    dd = build_layerwise_model(cfg, 3, seed=0)
    configure_local_model(dd, "last_block", depth_dropout=1.0, dropout_seed=1)
    dd.train()
    dd.backbone(torch.rand(2, 3, 32, 32))
    assert dd.backbone.last_skipped_blocks == (0, 1)  # only frozen blocks are ever skipped


# ---------------------------------------------------------------------- the alignment loss


def test_alignment_loss_matches_a_hand_computation():
    rng = np.random.default_rng(0)
    local = rng.normal(size=(5, 4))
    glob = rng.normal(size=(5, 4))
    tau = 0.3
    expected = 0.0
    for i in range(5):
        sims = [
            float(local[i] @ glob[j]) / (np.linalg.norm(local[i]) * np.linalg.norm(glob[j])) / tau for j in range(5)
        ]
        expected += -sims[i] + math.log(sum(math.exp(s) for s in sims))
    expected /= 5
    value = alignment_loss(torch.tensor(local), torch.tensor(glob), tau)
    assert float(value) == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="temperature"):
        alignment_loss(torch.tensor(local), torch.tensor(glob), 0.0)


def test_aligner_adds_alpha_times_the_term_on_the_steps_own_representations():
    cfg = experiment()
    method = build_layerwise_model(cfg, 2, seed=0)
    configure_local_model(method, "last_block")
    received = build_layerwise_model(cfg, 2, seed=1).backbone  # a different "global" model
    aligner = RepresentationAligner(received, alpha=0.5, temperature=0.2)
    assert aligner.symmetric and aligner.global_views == 2
    method.eval()  # no BN batch statistics: the same numbers every call
    v1, v2 = torch.rand(6, 3, 32, 32), torch.rand(6, 3, 32, 32)
    total = aligner.step(method, v1, v2)
    with torch.no_grad():
        g1, g2 = received(v1), received(v2)
    # Algorithm 2 line 12: l(z1_local, z2_global) + l(z2_local, z1_global)
    term = alignment_loss(method.backbone(v1), g2, 0.2) + alignment_loss(method.backbone(v2), g1, 0.2)
    expected = method.training_step(v1, v2) + 0.5 * term
    assert float(total.detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
    one_sided = RepresentationAligner(received, alpha=0.5, temperature=0.2, symmetric=False)
    half = method.training_step(v1, v2) + 0.5 * alignment_loss(method.backbone(v1), g2, 0.2)
    assert float(one_sided.step(method, v1, v2).detach()) == pytest.approx(float(half.detach()), rel=1e-5)
    assert float(alignment_loss(method.backbone(v2), g1, 0.2)) > 0.1  # the second half is not negligible
    total.backward()
    assert all(p.grad is None for p in aligner.global_backbone.parameters())  # the global copy is frozen
    # As train_ssl's loss hook: the term of the step that just ran, then nothing is kept
    aligner.attach(method)
    method.training_step(v1, v2)
    assert float(aligner.loss(method).detach()) == pytest.approx(0.5 * aligner.values[-1])
    with pytest.raises(RuntimeError, match="both views"):
        aligner.loss(method)
    aligner.detach()


# ---------------------------------------------------------------------- server-side calibration


def test_calibration_changes_every_block_of_the_sub_model():
    cfg = experiment(**{"train.max_steps_per_epoch": 2})
    data = load_experiment_data(cfg)
    aux = public_images(cfg, data)
    method = build_layerwise_model(cfg, 3, seed=0)
    configure_local_model(method, "last_block")  # calibration trains everything regardless
    before = online_state(method)
    stats = calibrate(cfg, method, aux, epochs=1, lr=1e-3, seed=0)
    after = online_state(method)
    assert stats.steps >= 1
    parameters = {name for name, _ in method.named_parameters() if not name.startswith("target_")}
    changed = {k for k in parameters if not np.array_equal(before[k], after[k])}
    assert changed == parameters  # every block, the embeddings, the final norm and the heads
    for i in range(3):
        assert any(k.startswith(f"backbone.blocks.{i}.") for k in changed)


def test_calibration_trains_with_the_experiments_train_settings(monkeypatch):
    """The server's calibration and the clients' rounds take the experiment's training settings from one place
    (``train_settings``): a setting of the train section reaches both."""
    from client_app.rounds import weights
    from ssl_models.federated import layerwise

    overrides = {
        "train.optimizer": "adamw",
        "train.weight_decay": 0.05,
        "train.drop_last": False,
        "train.max_steps_per_epoch": 1,
        "train.fast_path": False,
        "augment.blur_p": 0.0,
    }
    cfg = experiment(**overrides)
    seen = []

    def fake_train_ssl(method, images, **kwargs):
        seen.append(kwargs)
        raise StopIteration  # the call's arguments are what is tested

    aux = np.zeros((8, 32, 32, 3), dtype=np.uint8)
    monkeypatch.setattr(layerwise, "train_ssl", fake_train_ssl)
    with pytest.raises(StopIteration):
        calibrate(cfg, build_layerwise_model(cfg, 1, seed=0), aux, epochs=1, lr=1e-3, seed=0)
    monkeypatch.setattr(weights, "train_ssl", fake_train_ssl)
    with pytest.raises(StopIteration):
        weights.local_training(cfg, build_layerwise_model(cfg, 1, seed=0), aux, lr=1e-3, seed=0, device="cpu")
    for kwargs in seen:
        assert (kwargs["optimizer"], kwargs["weight_decay"], kwargs["drop_last"]) == ("adamw", 0.05, False)
        assert (kwargs["max_steps_per_epoch"], kwargs["fast_path"], kwargs["augment"].blur_p) == (1, False, 0.0)
        assert kwargs["momentum"] == cfg.train.momentum
    assert len(seen) == 2


# ---------------------------------------------------------------------- the strategy: bytes of every message kind


def make_strategy(variant: str, cfg, n: int = 2, **kw):
    data = load_experiment_data(cfg)
    cls = get_strategy_class(variant)
    strategy = cls(
        clients={pid: 100 + pid for pid in range(n)},
        clients_per_round=n,
        seed=0,
        node_wait_s=0.0,
        round_config=lambda r: {"lr": cfg.round_lr(r)},
        options=cfg.strategy.options,
        **kw,
    )
    strategy.prepare(cfg, data, federated_split(cfg, data.y_train))
    initial = build_ssl_model(cfg, seed=cfg.seed)  # what the ServerApp builds: the 12-block ViT
    arrays = to_array_record(state_to_numpy(split_state(initial, strategy.exchange_prefixes(initial))[0]))
    return strategy, arrays


def fake_replies(strategy, messages, failing=()):
    """Replies as a client would send them: exactly the trained entries (slightly moved)."""
    replies = []
    for m in messages:
        pid = m.metadata.dst_node_id - 100
        if pid in failing:
            replies.append(Message(Error(code=0, reason="boom"), reply_to=m))
            continue
        keys = strategy.trained_keys(m.content["config"]["lw-stage"])
        upload = OrderedDict(
            (k, strategy.global_state[k] + np.asarray(0.01, dtype=strategy.global_state[k].dtype)) for k in keys
        )
        metrics = MetricRecord({"partition-id": pid, "num-examples": 10 + pid, "train_loss": 1.0, "train_s": 0.1})
        replies.append(Message(RecordDict({"arrays": to_array_record(upload), "metrics": metrics}), reply_to=m))
    return replies


def run_round(strategy, r, arrays, nodes, failing=()):
    msgs = list(strategy.configure_train(r, arrays, ConfigRecord({"experiment": "{}"}), NodeGrid(nodes)))
    new, _ = strategy.aggregate_train(r, fake_replies(strategy, msgs, failing))
    return {m.metadata.dst_node_id - 100: m for m in msgs}, (new if new is not None else arrays)


def shapes_at(cfg, depth):
    """Every online entry of the depth-s sub-model as zero arrays of its shape and dtype (hand counting)."""
    model = build_layerwise_model(cfg, depth, seed=0)
    return OrderedDict((k, np.zeros(tuple(v.shape), dtype=v.numpy().dtype)) for k, v in model.state_dict().items())


def by_hand(cfg, depth, prefixes):
    return hand_bytes(select(shapes_at(cfg, depth), prefixes))


HEADS = ("projector.", "predictor.")


def block(i):  # 1-based block i
    return f"backbone.blocks.{i - 1}."


@pytest.mark.parametrize("variant", ["lwfedssl", "fedmoco_lw", "prog_fedssl", "fll_dd"])
def test_bytes_of_every_message_kind_counted_by_hand(variant):
    # 3 stages of 2 rounds; rounds 3 and 5 start stages 2 and 3
    cfg = experiment(variant, **{"train.max_steps_per_epoch": 1})
    strategy, arrays = make_strategy(variant, cfg)
    nodes = [100, 101]
    embed = ("backbone.patch_embed.", "backbone.cls_token", "backbone.pos_embed")
    norm = ("backbone.norm.",)
    for r in range(1, 7):
        msgs, arrays = run_round(strategy, r, arrays, nodes)
        s = stage_of_round(r, strategy.rounds_per_stage).stage
        whole = embed + tuple(block(i) for i in range(1, s + 1)) + norm + HEADS
        active = (embed if s == 1 else ()) + (block(s),) + norm + HEADS
        if variant == "lwfedssl":
            down, up = whole, active  # calibration changed every entry: blocks 1..s + heads down
        elif variant == "prog_fedssl":
            down = up = whole
        else:  # FedMoCo-LW / FLL+DD: block s (+ norm, heads); at a stage start also the final aggregate of what
            up = active  # the client trained in the previous stage (block s-1, and at stage 2 the embeddings)
            down = active + ((embed if s == 2 else ()) + (block(s - 1),) if r in (3, 5) else ())
        record = strategy.round_records[r]
        assert record["stage"] == s and record["depth"] == s
        for pid, m in msgs.items():
            assert m.metadata.message_type == LAYERWISE_MESSAGE_TYPE
            assert from_array_record(m.content["arrays"]).keys() == select(shapes_at(cfg, s), down).keys(), (r, pid)
            client = next(c for c in record["clients"] if c["id"] == pid)
            assert client["bytes_down"] == by_hand(cfg, s, down), (variant, r)
            assert client["bytes_up"] == by_hand(cfg, s, up), (variant, r)
            # encoder: the raw bytes of the backbone entries; the rest (heads, manifest, frame) completes the message
            encoder_down = raw_bytes(select(shapes_at(cfg, s), tuple(p for p in down if p.startswith("backbone"))))
            assert client["bytes_down_encoder"] == encoder_down
            assert client["bytes_down_heads"] == by_hand(cfg, s, down) - encoder_down
            assert client["bytes_up_encoder"] == raw_bytes(
                select(shapes_at(cfg, s), tuple(p for p in up if p.startswith("backbone")))
            )
            assert client["bytes_up_encoder"] + client["bytes_up_heads"] == client["bytes_up"]
        assert (
            record["bytes_down"]
            == 2 * by_hand(cfg, s, down)
            == record["bytes_down_encoder"] + record["bytes_down_heads"]
        )
        assert record["bytes_up"] == 2 * by_hand(cfg, s, up) == record["bytes_up_encoder"] + record["bytes_up_heads"]
    assert strategy.depth == 3
    model = strategy.models_to_evaluate(arrays)["global"]
    assert model.depth == 3 and len(from_array_record(model.arrays)) == len(shapes_at(cfg, 3)) - len(
        [k for k in shapes_at(cfg, 3) if k.startswith("target_")]
    )
    resources = strategy.summary_extras({})["resources"]
    assert resources["run"]["bytes_down"] == sum(r["bytes_down"] for r in strategy.round_records.values())
    assert resources["per_client"]["0"]["rounds"] == 6


def test_lwfedssl_calibrates_at_the_round_start_before_the_clients_and_the_others_do_not():
    """Algorithm 1 lines 4-9: each round the server appends the stage's block, then calibrates the whole sub-model
    for E epochs with the local-training settings (E = train.local_epochs by default), and only then sends it; the
    model after the round (evaluated, saved) is the FedAvg of the uploads, not calibrated again."""
    cfg = experiment("lwfedssl", **{"train.local_epochs": 2, "train.max_steps_per_epoch": 1})
    strategy, arrays = make_strategy("lwfedssl", cfg)
    assert strategy.options["calibration_epochs"] is None and strategy.calibration_epochs == 2
    calls = []
    real = strategy._calibrate

    def spy(server_round):
        calls.append((server_round, strategy.depth, dict(strategy.global_state)))
        real(server_round)

    strategy._calibrate = spy
    new_arrays = arrays
    for r in (1, 2, 3):  # stages of 2 rounds: round 3 appends block 2 first
        msgs = list(strategy.configure_train(r, new_arrays, ConfigRecord({"experiment": "{}"}), NodeGrid([100, 101])))
        assert calls[-1][0] == r and calls[-1][1] == strategy.position(r).stage  # grown, then calibrated
        calibrated = dict(strategy.global_state)
        for m in msgs:  # the clients get the calibrated sub-model, every entry of it
            sent = from_array_record(m.content["arrays"])
            assert set(sent) == set(calibrated)
            for key, value in sent.items():
                np.testing.assert_array_equal(value, calibrated[key])
        changed = [k for k in calibrated if k.endswith("weight") and not np.array_equal(calibrated[k], calls[-1][2][k])]
        assert len(changed) == len([k for k in calibrated if k.endswith("weight")])  # calibration moved them all
        new, _ = strategy.aggregate_train(r, fake_replies(strategy, msgs))
        record = strategy.round_records[r]
        assert record["calibration"]["epochs"] == 2 and record["calibration"]["aux_images"] == len(strategy.aux)
        assert record["calibration"]["steps"] == 2  # 2 epochs x max_steps_per_epoch 1
        after = from_array_record(new)
        for key in strategy.trained_keys(strategy.depth):  # FedAvg of the uploads (calibrated + 0.01), as it is
            if calibrated[key].dtype.kind == "f":
                np.testing.assert_allclose(after[key], calibrated[key] + 0.01, rtol=1e-6, atol=1e-6)
        new_arrays = new
    assert [c[0] for c in calls] == [1, 2, 3]
    plain, arrays = make_strategy("fedmoco_lw", experiment("fedmoco_lw"))
    run_round(plain, 1, arrays, [100, 101])
    assert "calibration" not in plain.round_records[1]


def test_a_client_that_missed_stages_downloads_the_whole_sub_model():
    cfg = experiment("fedmoco_lw", **{"federation.num_clients": 3, "rounds": 8})
    strategy, arrays = make_strategy("fedmoco_lw", cfg, n=3, min_available=2)
    everything = [100, 101, 102]
    assert strategy.rounds_per_stage == [3, 3, 2]
    for r in (1, 2, 3):
        msgs, arrays = run_round(strategy, r, arrays, everything)
    for r in (4, 5, 6):  # client 2 misses stage 2
        msgs, arrays = run_round(strategy, r, arrays, [100, 101])
    msgs, arrays = run_round(strategy, 7, arrays, everything, failing=(1,))  # stage 3: client 2 is back
    whole = set(select(shapes_at(cfg, 3), submodel_prefixes(3, HEADS)))
    assert set(from_array_record(msgs[2].content["arrays"])) == whole
    assert set(from_array_record(msgs[0].content["arrays"])) == set(
        select(shapes_at(cfg, 3), (block(2), block(3), "backbone.norm.") + HEADS)
    )
    clients = {c["id"]: c for c in strategy.round_records[7]["clients"]}
    assert clients[2]["full_submodel_down"] and clients[2]["blocks_down"] == [1, 2, 3]
    assert not clients[0]["full_submodel_down"] and clients[0]["blocks_down"] == [2, 3]
    # Client 1's reply failed in round 7: it is sent everything next time; the others block s + norm + heads.
    assert sorted(clients) == [0, 2]
    msgs, arrays = run_round(strategy, 8, arrays, everything)
    assert set(from_array_record(msgs[1].content["arrays"])) == whole
    assert set(from_array_record(msgs[0].content["arrays"])) == set(
        select(shapes_at(cfg, 3), (block(3), "backbone.norm.") + HEADS)
    )


def test_entry_bytes_split_the_record_as_flower_counts_it():
    state = OrderedDict(
        [("backbone.blocks.0.w", np.zeros((3, 4), np.float32)), ("projector.0.weight", np.zeros(5, np.float32))]
    )
    record = to_array_record(state)
    encoder, rest = entry_bytes(record)
    # encoder: 12 float32; the rest: 5 float32, the manifest "backbone.blocks.0.w\t<f4\t3,4\nprojector.0.weight\t<f4\t5"
    # (27 + 1 + 24) and the packed record's frame (270)
    assert (encoder, rest) == (48, 20 + 52 + 270)
    assert encoder + rest == record.count_bytes() == hand_bytes(state)


# ---------------------------------------------------------------------- the client task


def test_client_round_trains_and_uploads_only_its_part_and_reports_resources():
    cfg = experiment("lwfedssl", **{"train.max_steps_per_epoch": 1, "train.batch_size": 16})
    images = client_images(cfg, 0)
    state = online_state(build_layerwise_model(cfg, 2, seed=0))
    plan = {
        "stage": 2,
        "trainable": "last_block",
        "alpha": 0.01,
        "align-temperature": 0.2,
        "accounting": True,
        "progress-start": 0.25,
        "progress-end": 0.5,
    }
    lw = layerwise_round(cfg, images, state, None, server_round=3, partition_id=0, lr=1e-3, plan=plan)
    assert list(lw.shared_state) == list(select(state, trained_prefixes(2, "last_block", HEADS)))
    for key in select(state, ("backbone.blocks.0.", "backbone.patch_embed.", "backbone.pos_embed")):
        np.testing.assert_array_equal(lw.client_state[key], state[key])  # frozen: untouched
    assert not np.array_equal(
        lw.shared_state["backbone.blocks.1.attn.qkv.weight"], state["backbone.blocks.1.attn.qkv.weight"]
    )
    assert int(lw.client_state["meta.depth"][0]) == 2 and lw.info["align_loss"] > 0
    assert lw.info["flops_align_forward"] > 0 and lw.info["mem_total"] > lw.info["mem_activations"] > 0
    assert lw.info["flops_fvcore_equivalent"] == pytest.approx(lw.info["flops_forward"] / 2)
    assert lw.info["rss_peak_bytes"] > 0 and lw.info["images_trained"] == 16
    pure = layerwise_round(
        cfg, images, state, None, server_round=3, partition_id=0, lr=1e-3, plan={**plan, "alpha": 0.0}
    )
    assert pure.info["flops_total"] == pytest.approx(lw.info["flops_total"] - lw.info["flops_align_forward"])
    assert "align_loss" not in pure.info
    prog = layerwise_round(
        cfg,
        images,
        state,
        None,
        server_round=3,
        partition_id=0,
        lr=1e-3,
        plan={**plan, "alpha": 0.0, "trainable": "all"},
    )
    assert list(prog.shared_state) == list(state)  # the whole sub-model
    assert prog.info["flops_backward"] > pure.info["flops_backward"]
    assert prog.info["mem_activations"] > pure.info["mem_activations"]
    dd = layerwise_round(
        cfg,
        images,
        state,
        None,
        server_round=3,
        partition_id=0,
        lr=1e-3,
        plan={**plan, "alpha": 0.0, "depth-dropout": 0.5},
    )
    assert dd.info["flops_total"] == pytest.approx(pure.info["flops_total"])  # measured with nothing skipped
    assert dd.info["flops_expected"] < dd.info["flops_total"]
    # Next stage: the client holds block 1 (its state) and gets blocks 2 and 3 + norm + heads.
    grown = grow_online_state(cfg, OrderedDict((k, lw.client_state[k]) for k in state), "copy", seed=0)
    download = select(grown, (block(2), block(3), "backbone.norm.") + HEADS)
    nxt = layerwise_round(
        cfg,
        images,
        download,
        lw.client_state,
        server_round=5,
        partition_id=0,
        lr=1e-3,
        plan={**plan, "stage": 3, "accounting": False},
    )
    assert list(nxt.shared_state) == list(select(grown, trained_prefixes(3, "last_block", HEADS)))
    with pytest.raises(RuntimeError, match="lacks"):  # neither its state nor the download holds block 1
        layerwise_round(
            cfg,
            images,
            download,
            None,
            server_round=5,
            partition_id=0,
            lr=1e-3,
            plan={**plan, "stage": 3, "accounting": False},
        )


def test_fll_dd_runs_simclr_layer_by_layer_as_its_paper():
    """configs/lwfedssl/fll-dd.yaml: SimCLR (no predictor, no momentum encoder) on the growable ViT, depth dropout of
    the frozen blocks, block s + norm + projector up."""
    cfg = load_experiment(
        {
            "config": "configs/lwfedssl/fll-dd.yaml",
            "data.dataset": "synthetic",
            "data.synthetic_train": 200,
            "model.width": 0.125,
            "train.batch_size": 8,
            "train.max_steps_per_epoch": 1,
            "train.local_epochs": 1,
        }
    )[0]
    assert cfg.method.name == "simclr" and cfg.strategy.name == "fll_dd"
    state = online_state(build_layerwise_model(cfg, 2, seed=0))
    assert {k.split(".")[0] for k in state} == {"backbone", "projector"}
    plan = {"stage": 2, "trainable": "last_block", "depth-dropout": 0.5, "accounting": False}
    dd = layerwise_round(cfg, client_images(cfg, 0), state, None, server_round=3, partition_id=0, lr=1e-3, plan=plan)
    assert list(dd.shared_state) == list(select(state, trained_prefixes(2, "last_block", ("projector.",))))
    assert dd.info["depth_dropout"] == 0.5 and np.isfinite(dd.stats.loss)


def test_fedmocov3_is_fedssl_with_mocov3_on_the_whole_vit_of_its_config():
    cfg = load_experiment(
        {
            "config": "configs/lwfedssl/cpu-compare-fedmocov3.yaml",
            "data.dataset": "synthetic",
            "data.synthetic_train": 200,
            "data.max_train": 0,
            "train.max_steps_per_epoch": 1,
            "model.width": 0.125,
            "train.batch_size": 8,
        }
    )[0]
    assert cfg.strategy.name == "fedssl" and cfg.method.name == "mocov3"
    method = build_ssl_model(cfg, seed=0)
    shared = state_to_numpy(split_state(method, method.shared_prefixes())[0])
    result = train_local_ssl(cfg, client_images(cfg, 0), shared, None, server_round=1, partition_id=0, lr=1e-3)
    # the whole encoder both ways, as deep as the layer-wise rows end (model.options.depth = their 6 stages)
    assert cfg.model.options == {"depth": 6} and len(method.backbone.blocks) == 6
    assert set(result.shared_state) == set(shared)
    assert any(k.startswith("backbone.blocks.5.") for k in shared) and any(k.startswith("predictor.") for k in shared)
    # Algorithm 3 line 1: every round the client's momentum encoder restarts from the received encoder (the
    # config's update_both), not from the client's own last target, which it otherwise keeps.
    assert cfg.strategy.options["update_both"]
    received = {k: v + np.float32(0.5) if v.dtype.kind == "f" else v for k, v in shared.items()}
    own_target = {
        f"target_{k}": v - np.float32(0.5) if v.dtype.kind == "f" else v
        for k, v in shared.items()
        if k.startswith(("backbone.", "projector."))
    }
    own = {**result.local_state, **own_target}
    for update_both, expected in ((True, received), (False, {k[len("target_") :]: v for k, v in own_target.items()})):
        client = build_ssl_model(cfg, seed=0)
        fedssl_download(client, received, own, 2, {"update_both": update_both})
        target = {
            k[len("target_") :]: v
            for k, v in state_to_numpy(client.state_dict()).items()
            if k.startswith(TARGET_PREFIXES)
        }
        assert target
        for key, value in target.items():
            if value.dtype.kind == "f":
                np.testing.assert_allclose(value, expected[key], rtol=1e-6, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------------- evaluation of a grown encoder


def test_grown_encoder_is_evaluated_and_checkpointed_at_its_depth(tmp_path):
    from server_app.app import ServerEvaluator

    cfg = experiment(**{"eval.max_train": 50, "eval.max_test": 20})
    state = online_state(build_layerwise_model(cfg, 3, seed=1))
    evaluator = ServerEvaluator(cfg)
    backbone = evaluator.load(ModelToEvaluate("vit_tiny", to_array_record(state), depth=3))
    assert len(backbone.blocks) == 3
    np.testing.assert_array_equal(
        backbone.state_dict()["blocks.2.attn.qkv.weight"].numpy(), state["backbone.blocks.2.attn.qkv.weight"]
    )
    path = save_encoder_checkpoint(tmp_path / "model.pt", backbone, "vit_tiny", cfg.model.width)
    loaded, info = load_encoder_checkpoint(path)
    assert info["arch_options"] == {"depth": 3} and len(loaded.blocks) == 3
    x = torch.rand(2, 3, 32, 32)
    backbone.eval()
    torch.testing.assert_close(loaded(x), backbone(x))
    reference = evaluator.random_init("vit_tiny", linear=False)  # at the depth of the model scored
    assert 0.0 <= reference["knn_acc"] <= 1.0 and evaluator.depths["vit_tiny"] == 3


# ---------------------------------------------------------------------- options and configs


def test_registry_and_variants():
    assert {name: get_strategy_class(name) for name in ("lwfedssl", "fedmoco_lw", "prog_fedssl", "fll_dd")} == {
        "lwfedssl": LWFedSSL,
        "fedmoco_lw": FedMoCoLW,
        "prog_fedssl": ProgFedSSL,
        "fll_dd": FLLDD,
    }
    assert ProgFedSSL.trainable_mode == "all" and FedMoCoLW.trainable_mode == "last_block"
    assert FLLDD.default_options()["depth_dropout"] == 0.5 and LWFedSSL.default_options()["alpha"] == 0.01


@pytest.mark.parametrize(
    ("variant", "options", "match"),
    [
        ("lwfedssl", {"stages": 0}, r"strategy\.options\.stages: must be an integer >= 1"),
        ("fedmoco_lw", {"allocation": "skewed"}, r"strategy\.options\.allocation: must be one of"),
        ("prog_fedssl", {"new_block_init": "zeros"}, r"strategy\.options\.new_block_init: must be one of"),
        ("fll_dd", {"lr_strategy": "step"}, r"strategy\.options\.lr_strategy: must be one of"),
        ("fll_dd", {"depth_dropout": 1.5}, r"strategy\.options\.depth_dropout: must be in \[0, 1\]"),
        ("lwfedssl", {"alpha": -0.1}, r"strategy\.options\.alpha: must be >= 0"),
        ("lwfedssl", {"align_temperature": 0.0}, r"strategy\.options\.align_temperature: must be > 0"),
        ("lwfedssl", {"calibration_epochs": -1}, r"strategy\.options\.calibration_epochs: must be an integer >= 0"),
        ("lwfedssl", {"calibration_batch_size": 1}, r"strategy\.options\.calibration_batch_size: must be 0"),
        ("fedmoco_lw", {"client_target": "ema"}, r"strategy\.options\.client_target: must be one of"),
        ("fedmoco_lw", {"update_both": True}, r"strategy\.options\.update_both: not supported"),
    ],
)
def test_option_errors_name_the_key(variant, options, match):
    cls = get_strategy_class(variant)
    with pytest.raises(ValueError, match=match):
        cls.check_options({**cls.default_options(), **options})


def smoke_with(tmp_path, **dotted) -> Path:
    """The smoke config with ``dotted`` settings (strategy options cannot come from the run config)."""
    raw = yaml.safe_load((REPO / SMOKE).read_text())
    for key, value in dotted.items():
        set_dotted(raw, key, value)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"model.arch": "resnet18"}, r"^model\.arch: strategy 'lwfedssl' grows a ViT"),
        ({"rounds": 2}, r"^rounds: 2 rounds cannot hold strategy\.options\.stages=3"),
        ({"data.public_size": 0.0}, r"^data\.public_size: LW-FedSSL calibrates on the server's auxiliary data"),
        ({"strategy.name": "fedmoco_lw", "strategy.options.alpha": 0.1}, r"^strategy\.options\.alpha: unknown option"),
        ({"strategy.options.stages": 3.0}, r"^strategy\.options\.stages: expected int"),
        (
            {"strategy.name": "fll_dd", "strategy.options.depth_dropout": 2.0},
            r"^strategy\.options\.depth_dropout: must be in \[0, 1\]",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_experiment({"config": str(smoke_with(tmp_path, **overrides)), "data.dataset": "synthetic"})


def test_lwfedssl_without_calibration_needs_no_auxiliary_data(tmp_path):
    path = smoke_with(tmp_path, **{"data.public_size": 0.0, "strategy.options.calibration_epochs": 0})
    cfg = load_experiment({"config": str(path), "data.dataset": "synthetic"})[0]
    assert cfg.strategy.options["calibration_epochs"] == 0


LW_CONFIGS = experiment_config_files(REPO / "configs/lwfedssl") + [REPO / SMOKE]


@pytest.mark.parametrize("path", LW_CONFIGS, ids=[str(p.relative_to(REPO)) for p in LW_CONFIGS])
def test_every_lwfedssl_config_loads_and_states_its_scale(path):
    cfg, _ = load_experiment({"config": str(path)})
    header = "\n".join(line for line in path.read_text().splitlines() if line.startswith("#"))
    assert "Scale" in header
    # FLL+DD runs SimCLR, as its paper does; every other row MoCo v3
    assert cfg.model.arch == "vit_tiny" and cfg.method.name == ("simclr" if path.stem == "fll-dd" else "mocov3")
    assert cfg.train.weight_decay == pytest.approx(1e-5)  # the pinned text's AdamW weight decay
    if cfg.strategy.name == "fedssl":
        assert cfg.strategy.options["update_both"]  # Algorithm 3 line 1: the target starts from the received model
    else:
        cls = get_strategy_class(cfg.strategy.name)
        assert cfg.rounds >= cfg.strategy.options["stages"]
        assert (
            sum(stage_rounds(cfg.rounds, cfg.strategy.options["stages"], cfg.strategy.options["allocation"]))
            == cfg.rounds
        )
        assert cls in (LWFedSSL, FedMoCoLW, ProgFedSSL, FLLDD)


def test_main_comparison_holds_the_papers_settings():
    main = {
        p.stem: load_experiment({"config": str(p)})[0]
        for p in (REPO / "configs/lwfedssl").glob("*.yaml")
        if not p.stem.startswith("cpu-compare")
    }
    assert sorted(main) == ["fedmoco-lw", "fedmocov3", "fll-dd", "lwfedssl", "prog-fedssl"]
    for name, cfg in main.items():
        batch = 512 if name == "fll-dd" else 1024  # FLL+DD: SimCLR at batch 512, as its paper
        assert (cfg.federation.num_clients, cfg.rounds, cfg.train.batch_size, cfg.train.local_epochs) == (
            10,
            180,
            batch,
            3,
        )
        assert cfg.train.lr == pytest.approx(1.5e-4 * batch / 256) and cfg.train.optimizer == "adamw"
        assert cfg.train.weight_decay == pytest.approx(1e-5)
        assert cfg.method.options["proj_hidden_dim"] == 4096 and cfg.method.options["proj_out_dim"] == 256
        assert cfg.method.options["temperature"] == 0.2
        assert cfg.method.name == ("simclr" if name == "fll-dd" else "mocov3")
        if cfg.method.name == "mocov3":
            assert cfg.method.options["momentum"] == 0.99
        assert cfg.data.public_size == 0.1
        if name != "fedmocov3":
            assert cfg.strategy.options["stages"] == 12 and stage_rounds(180, 12) == [15] * 12
    assert main["lwfedssl"].strategy.options["alpha"] == 0.01 and main["lwfedssl"].strategy.options["align_symmetric"]
    assert main["lwfedssl"].strategy.options["calibration_epochs"] is None  # = the 3 local epochs
    assert main["fll-dd"].strategy.options["depth_dropout"] == 0.5
    assert main["fedmocov3"].strategy.name == "fedssl"

    def study(name):
        return study_experiments(f"paper/lwfedssl-{name}").values()

    assert sorted(c.strategy.options["alpha"] for c in study("alpha")) == [0.0, 0.001, 0.01, 0.1, 1.0]
    assert sorted(c.data.public_size for c in study("aux-data")) == [0.01, 0.05, 0.1, 0.2]
    for cfg in study("batch-size"):
        assert cfg.train.lr == pytest.approx(1.5e-4 * cfg.train.batch_size / 256)
    assert {c.strategy.options["lr_strategy"] for c in study("lr-strategy")} == {"fixed", "cosine", "cyclic"}
    schedules = study_experiments("paper/lwfedssl-rounds-per-stage")
    assert {c.strategy.options["allocation"] for c in schedules.values()} == {"uniform", "right_skewed", "left_skewed"}
    assert sorted(c.rounds for n, c in schedules.items() if n.startswith("lwfedssl-rs")) == [60, 120, 180, 240]
    for name in ("alpha", "aux-data", "batch-size", "clients", "lr-strategy", "rounds-per-stage"):
        for cfg in study(name):  # the paper's fixes hold in every cell of every study
            assert cfg.train.weight_decay == pytest.approx(1e-5)
            if cfg.strategy.name == "fedssl":
                assert cfg.strategy.options["update_both"]


def test_client_target_keep_carries_the_momentum_encoder_and_reset_restarts_it(tmp_path):
    path = smoke_with(
        tmp_path, **{"method.options.momentum": 1.0, "train.max_steps_per_epoch": 1, "train.batch_size": 8}
    )  # m = 1: the target never moves, so it shows its origin
    cfg = load_experiment({"config": str(path), "data.dataset": "synthetic", "data.synthetic_train": 300})[0]
    images = client_images(cfg, 0)
    plan = {"stage": 1, "trainable": "last_block", "accounting": False, "client-target": "keep"}
    start = online_state(build_layerwise_model(cfg, 1, seed=0))
    first = layerwise_round(cfg, images, start, None, server_round=1, partition_id=0, lr=1e-3, plan=plan)
    np.testing.assert_array_equal(
        first.client_state["target_backbone.blocks.0.mlp.fc1.weight"], start["backbone.blocks.0.mlp.fc1.weight"]
    )  # first round: a copy of the download
    grown = grow_online_state(cfg, start, "copy", seed=0)  # a "global" stage-2 model unlike the client's
    download = select(grown, submodel_prefixes(2, HEADS))
    for key in download:
        if download[key].dtype.kind == "f":
            download[key] = download[key] + np.float32(0.5)
    kept = layerwise_round(
        cfg, images, download, first.client_state, server_round=2, partition_id=0, lr=1e-3, plan={**plan, "stage": 2}
    )
    np.testing.assert_array_equal(
        kept.client_state["target_backbone.blocks.0.mlp.fc1.weight"],
        first.client_state["target_backbone.blocks.0.mlp.fc1.weight"],
    )  # its own
    np.testing.assert_array_equal(
        kept.client_state["target_backbone.blocks.1.mlp.fc1.weight"], download["backbone.blocks.1.mlp.fc1.weight"]
    )  # the new block: as received
    reset = layerwise_round(
        cfg,
        images,
        download,
        first.client_state,
        server_round=2,
        partition_id=0,
        lr=1e-3,
        plan={**plan, "stage": 2, "client-target": "reset"},
    )
    assert not any(k.startswith("target_") for k in reset.client_state)  # nothing to keep
    assert not any(k.startswith("target_") for k in reset.shared_state)


def test_a_resumed_strategy_sends_what_the_uninterrupted_one_sends():
    import json

    cfg = experiment("fedmoco_lw", **{"federation.num_clients": 3, "rounds": 8})
    a, arrays = make_strategy("fedmoco_lw", cfg, n=3, min_available=2)
    for r, nodes in ((1, [100, 101, 102]), (2, [100, 101, 102]), (3, [100, 101]), (4, [100, 101])):
        _, arrays = run_round(a, r, arrays, nodes)
    plain, state_arrays, stores = a.checkpoint_state()
    plain = json.loads(json.dumps(plain))  # what meta.json keeps
    b, _ = make_strategy("fedmoco_lw", cfg, n=3, min_available=2)
    b.restore_state(plain, state_arrays, stores)
    checkpoint_arrays = to_array_record(from_array_record(arrays))
    sent_a = {
        m.metadata.dst_node_id: from_array_record(m.content["arrays"])
        for m in a.configure_train(5, arrays, ConfigRecord({"experiment": "{}"}), NodeGrid([100, 101, 102]))
    }
    sent_b = {
        m.metadata.dst_node_id: from_array_record(m.content["arrays"])
        for m in b.configure_train(5, checkpoint_arrays, ConfigRecord({"experiment": "{}"}), NodeGrid([100, 101, 102]))
    }
    assert sent_a.keys() == sent_b.keys() == {100, 101, 102}
    for node, state_a in sent_a.items():
        assert list(state_a) == list(sent_b[node])  # client 2 (it missed stage 2) gets everything in both
        for key in state_a:
            np.testing.assert_array_equal(state_a[key], sent_b[node][key])
    assert b.resources["per_client"] == a.resources["per_client"]
