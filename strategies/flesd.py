"""FLESD (Shi et al., "Federated Self-Supervised Contrastive Learning via Ensemble Similarity Distillation").

Clients send no weights: after local SSL training each client uploads the similarity matrix
``M_k = z z^T`` of its L2-normalised projections of a public image set that the server and every client
hold identically (checked by a content hash). The server ensembles ``exp((M_k - rowmax) / tau_T)`` over the
round's clients and distils the ensemble into the global model (a momentum key encoder and a FIFO queue of
anchor keys with their public-set indices, KL to the renormalised ensemble rows). The distilled model goes
back to the clients whose encoder has the global architecture; the others keep their own weights, so a
federation may mix encoders (``model.client_archs``).

Math: ``ssl_models/federated/similarity.py`` (ensemble, top-n% transport) and ``ssl_models/federated/distillation.py``.
"""

from __future__ import annotations

import time
from logging import INFO
from typing import TYPE_CHECKING, Any, cast

from flwr.app import ArrayRecord, Message
from flwr.common.logger import log

from fedssl_wire import SIMILARITY_MESSAGE_TYPE, SIMILARITY_RECORD, from_array_record, to_array_record
from ssl_models.data.splits import images_digest, public_images
from ssl_models.factory import build_augment, build_ssl_model, load_partial_state, split_state, state_to_numpy
from ssl_models.federated.distillation import QUEUE_WARMUPS, build_key_encoder, distill
from ssl_models.federated.similarity import ENCODING_MODES, SPARSIFY_VARIANTS, TOPK, ensemble_similarity, payload_kind
from ssl_models.training import resolve_device

from .fedssl import FedSSL
from .options import check_choice, check_positive, check_unit

if TYPE_CHECKING:
    from torch import nn

PUBLIC_SOURCES = ("split", "client0")
KEY_ENCODERS = ("carry_over", "fresh_each_round")


class FLESD(FedSSL):
    name = "flesd"
    client_update = "fedssl"  # a client of the global architecture takes the distilled model as it is
    supports_mixed_archs = True
    message_type = SIMILARITY_MESSAGE_TYPE
    target_options = False  # clients exchange no weights upward

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            # Public set: the server-held split (data.public_size) or, as in the official code, client 0's
            # partition (client 0 then does not train).
            "public_source": "split",
            # Upload: dense-fp32, dense-fp16, or topk (the top n% entries of each row as fp16 values + indices).
            "similarity": "topk",
            "topk_fraction": 0.1,  # similarity topk: fraction of each row kept, in (0, 1] (floor(f N) + 1 entries)
            # zero_similarity: a dropped similarity is 0 before the exp (the paper's text and the official code);
            # zero_probability: a dropped entry gets probability 0 (masked after the exp).
            "sparsify": "zero_similarity",
            "target_temperature": 0.1,  # tau_T of the ensemble
            "student_temperature": 0.1,  # tau_S of the distillation
            "distill_iterations": 1000,  # J
            "distill_batch_size": 128,  # B, public images per distillation step (at most the public set)
            "queue_size": 2048,  # K, anchor keys in the distillation's queue
            "distill_momentum": 0.999,  # EMA momentum of the momentum key encoder, in [0, 1]
            "distill_lr": 1e-3,  # Adam learning rate of the distillation (> 0)
            "distill_weight_decay": 1e-6,  # Adam weight decay of the distillation
            # start: the first ceil(K / B) iterations only fill the queue; every_epoch: at every epoch over the
            # public set, as the official code.
            "queue_warmup": "start",
            # carry_over: the momentum key encoder continues across rounds; fresh_each_round: a new copy of the
            # student at every round's distillation, as the official code.
            "key_encoder": "carry_over",
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "public_source", PUBLIC_SOURCES)
        check_choice(options, "similarity", ENCODING_MODES)
        if options["sparsify"] in ("paper", "code"):
            raise ValueError(
                f"strategy.options.sparsify: {options['sparsify']!r} was renamed by what it does: "
                "zero_similarity (dropped similarities set to 0 before the exp, the paper's text and the "
                "official code; formerly 'code') or zero_probability (formerly 'paper')"
            )
        check_choice(options, "sparsify", SPARSIFY_VARIANTS)
        check_choice(options, "queue_warmup", QUEUE_WARMUPS)
        check_choice(options, "key_encoder", KEY_ENCODERS)
        check_unit(options, "topk_fraction")
        check_positive(options, "topk_fraction")
        for key in (
            "target_temperature",
            "student_temperature",
            "distill_iterations",
            "distill_batch_size",
            "queue_size",
            "distill_lr",
        ):
            check_positive(options, key)
        if float(options["distill_weight_decay"]) < 0:
            raise ValueError(
                f"strategy.options.distill_weight_decay: must be >= 0, got {options['distill_weight_decay']!r}"
            )
        check_unit(options, "distill_momentum")

    def prepare(self, cfg, data, split) -> None:
        super().prepare(cfg, data, split)
        self.public = public_images(cfg, data, self.options["public_source"])
        self.public_digest = images_digest(self.public)
        self.device = resolve_device(cfg.train.device)
        self.model = build_ssl_model(cfg, seed=cfg.seed)
        self.key_encoder: nn.Module | None = (
            None  # the momentum encoder (carried over between rounds unless fresh_each_round)
        )
        # The local augmentation recipe (the experiment's ``augment`` section) makes the distillation's views.
        self.augment = build_augment(cfg, int(self.public.shape[1]))
        self.distill_stats: dict[int, dict[str, Any]] = {}
        log(INFO, "FLESD public set: %d images, sha256 %s", len(self.public), self.public_digest[:16])

    def traffic(self, model_bytes: int) -> str:
        n, o = len(self.public), self.options
        form = f"top {o['topk_fraction']:g} of each row" if o["similarity"] == TOPK else o["similarity"]
        return (
            f"down: the distilled model, {model_bytes / 2**20:.2f} MiB, to the clients of {self.cfg.model.arch} "
            f"only; up: no weights, a {n} x {n} similarity matrix of the public set per client ({form})"
        )

    def trainable(self, available: list[int]) -> list[int]:
        if self.options["public_source"] == "client0":
            return [pid for pid in available if pid != 0]
        return available

    def client_config(self, server_round: int) -> dict[str, Any]:
        o = self.options
        return {
            **super().client_config(server_round),
            "public-source": o["public_source"],
            "public-digest": self.public_digest,
            "similarity": o["similarity"],
            "topk-fraction": float(o["topk_fraction"]) if o["similarity"] == TOPK else 0.0,
        }

    def arrays_for_client(self, server_round: int, partition_id: int, arrays: ArrayRecord) -> ArrayRecord:
        """The distilled model only for clients of the global architecture; others keep their own."""
        if self.cfg.client_arch(partition_id) != self.cfg.model.arch:
            return ArrayRecord()
        return arrays

    def configure_train(self, server_round, arrays, config, grid):
        self._global = arrays  # the student of this round's distillation
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]) -> ArrayRecord:
        o = self.options
        n = len(self.public)
        t0 = time.perf_counter()
        # Decoded one upload at a time: the server holds the running ensemble plus one client's matrix.
        payloads = (from_array_record(cast(ArrayRecord, r.content[SIMILARITY_RECORD])) for r in replies)
        ensemble = ensemble_similarity(payloads, float(o["target_temperature"]), sparsify=o["sparsify"], n=n)
        ensemble_s = time.perf_counter() - t0
        load_partial_state(self.model, from_array_record(self._global))
        if self.key_encoder is None or o["key_encoder"] == "fresh_each_round":
            self.key_encoder = build_key_encoder(self.model)  # a copy of this round's student
        stats = distill(
            self.model,
            self.public,
            ensemble,
            iterations=int(o["distill_iterations"]),
            batch_size=min(int(o["distill_batch_size"]), n),
            queue_size=int(o["queue_size"]),
            momentum=float(o["distill_momentum"]),
            temperature=float(o["student_temperature"]),
            lr=float(o["distill_lr"]),
            weight_decay=float(o["distill_weight_decay"]),
            device=self.device,
            fast_path=self.cfg.train.fast_path,
            seed=self.seed * 1009 + server_round,
            key_encoder=self.key_encoder,
            augment=self.augment,
            queue_warmup=o["queue_warmup"],
        )
        self.model.cpu()
        del ensemble
        self.distill_stats[server_round] = {"ensemble_s": ensemble_s, **stats}
        log(
            INFO,
            "round %d: ensembled %d similarity matrices (%dx%d) in %.1f s, distilled %s steps in %.1f s (loss %.4f)",
            server_round,
            len(replies),
            n,
            n,
            ensemble_s,
            stats["steps"],
            stats["seconds"],
            stats["loss"],
        )
        shared, _ = split_state(self.model, self.exchange_prefixes(self.model))
        return to_array_record(state_to_numpy(shared))

    def checkpoint_state(self):
        plain, arrays, stores = super().checkpoint_state()
        if self.key_encoder is not None:  # carried over between rounds (key_encoder: carry_over)
            arrays = {
                **arrays,
                **{f"key_encoder.{k}": v.detach().cpu().numpy() for k, v in self.key_encoder.state_dict().items()},
            }
        return plain, arrays, stores

    def restore_state(self, plain, arrays, stores) -> None:
        super().restore_state(plain, arrays, stores)
        key_state = {k[len("key_encoder.") :]: v for k, v in arrays.items() if k.startswith("key_encoder.")}
        if key_state:
            self.key_encoder = build_key_encoder(self.model)
            load_partial_state(self.key_encoder, key_state)

    def expected_reply_arrays(self, server_round, partition_id):
        return None  # no weights come back: the similarity payload is checked in check_reply_payload

    def check_reply_payload(self, server_round, partition_id, reply):
        if SIMILARITY_RECORD not in reply.content.array_records:
            return f"no {SIMILARITY_RECORD!r} record"
        try:
            _, n = payload_kind(from_array_record(reply.content[SIMILARITY_RECORD]))
        except ValueError as exc:
            return f"similarity payload: {exc}"
        if n != len(self.public):
            return f"similarity payload is {n} x {n}, the public set has {len(self.public)} images"
        return None

    def aggregate_train(self, server_round, replies):
        replies = self.screen_replies(server_round, list(replies))
        for r in replies:  # a client on another public set would poison the ensemble: stop the run
            if r.has_error() and "public set mismatch" in r.error.reason:
                raise RuntimeError(f"round {server_round}: {r.error.reason}")
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.round_records.get(server_round)
        if record is not None and server_round in self.distill_stats:
            d = self.distill_stats[server_round]
            o = self.options
            record.update(
                distill_loss=d["loss"],
                distill_loss_first_quarter=d["loss_first_quarter"],
                distill_loss_last_quarter=d["loss_last_quarter"],
                distill_steps=d["steps"],
                distill_s=d["seconds"],
                distill_warmup_iterations=d["warmup_iterations"],
                ensemble_s=d["ensemble_s"],
                public_size=len(self.public),
                sparsify=o["sparsify"],
                queue_warmup=o["queue_warmup"],
                key_encoder=o["key_encoder"],
            )
        return arrays, metrics

    def client_record(self, reply: Message) -> dict[str, Any]:
        record = super().client_record(reply)
        record["arch"] = self.cfg.client_arch(record["id"])
        return record
