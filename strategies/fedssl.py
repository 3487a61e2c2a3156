"""Generalized FedSSL strategy (FedSimCLR, FedMoCo, FedBYOL, FedSimSiam of the FedEMA paper).

Each round the sampled clients receive the global online encoder + projector (+ predictor), train
locally with their SSL method, and upload the same parts; the server averages them weighted by each
client's number of examples. The target/momentum branch stays on the client. ``update_both`` (the FedEMA
paper's update-both): on download the client's target takes the global online weights too; nothing more
travels. ``aggregate_target`` (EasyFL's ``aggregation_content: all``, made explicit): clients also upload
their targets, the server averages them and the clients take the averaged target. The MoCo queue always
stays on the client.

The class only orchestrates: sampling, per-node messages, byte accounting and bookkeeping. The math
lives in ``strategies.aggregation``, the reply checks in ``strategies.replies``, the clients' resource book in
``strategies.resources``, waiting for nodes in ``strategies.nodes``; the training in the ClientApp.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from fedssl_wire import (
    CLIENT_STATE_MODES,
    CLIENT_STATE_RECORD,
    TRAIN_MESSAGE_TYPE,
    DiskStateStore,
    code_identity,
    from_array_record,
    readable_reason,
    record_bytes,
    to_array_record,
)

from .aggregation import sample_clients, weighted_average, weighted_mean
from .nodes import client_timeline, send_and_receive, wait_for_partitions
from .options import check_choice
from .replies import ArraySpec, array_spec, arrays_problem, metrics_problem, screen_replies, size_problem
from .resources import ClientResourceBook

DEFAULT_MAX_REPLY_BYTES = 8 * 2**30  # a reply larger than this is refused (federation.max_reply_mb sets it)


@dataclass(frozen=True)
class ModelToEvaluate:
    """One encoder the server scores: its architecture (to rebuild it), its exchanged state and, for a growable
    ViT (the layer-wise strategies), its depth in blocks (None: the architecture's default)."""

    arch: str
    arrays: ArrayRecord
    depth: int | None = None


class FedSSL(Strategy):
    """Example-weighted averaging of what clients upload, with seeded partial participation."""

    name = "fedssl"
    client_update = "fedssl"  # the ClientApp's client rule (client_app/rules/)
    supports_mixed_archs = False  # averaging weights needs one architecture
    message_type = TRAIN_MESSAGE_TYPE  # the ClientApp handler that serves a training round
    # Whether the target-branch options (update_both, aggregate_target) mean something for this strategy.
    target_options = True

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        # update_both: at download the client's target branch (BYOL target, MoCo key encoder) takes the global
        #   online weights too (the FedEMA paper's update-both); false: the target stays the client's own. For
        #   fedssl and fedprox (the other strategies refuse true); not with aggregate_target.
        # aggregate_target: clients also upload their target branch and take the server's average of it (EasyFL's
        #   "aggregate the target too"). For fedssl and fedprox, as update_both; not with update_both.
        # client_state: where each client's state lives between rounds (fedssl_wire.py): disk (a folder of the
        #   node's state-dir; in a simulation, of the run's output folder), memory (the SuperNode process's memory)
        #   or server (kept on the server's disk and travelling with every message).
        return {"update_both": False, "aggregate_target": False, "client_state": "disk"}

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Value checks beyond types; raise ValueError naming ``strategy.options.<key>``."""
        check_choice(options, "client_state", CLIENT_STATE_MODES)
        for key in ("update_both", "aggregate_target"):
            if options.get(key) and not cls.target_options:
                raise ValueError(
                    f"strategy.options.{key}: not supported by strategy {cls.name!r} "
                    "(it decides itself what happens to the target branch); keep it false"
                )
        if options.get("update_both") and options.get("aggregate_target"):
            raise ValueError(
                "strategy.options.aggregate_target: cannot be combined with update_both (update_both "
                "replaces the target by the global online weights, aggregate_target by the "
                "averaged targets); choose one"
            )

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of the experiment config this strategy needs (at load time, before anything starts); raise
        ValueError naming the dotted key."""

    def __init__(
        self,
        *,
        clients: dict[int, int],
        clients_per_round: int,
        min_available: int | None = None,
        node_wait_s: float = 300.0,
        seed: int = 0,
        round_config: Callable[[int], dict[str, Any]] | None = None,
        options: dict[str, Any] | None = None,
        state_dir: str | None = None,
    ) -> None:
        """``clients`` maps partition id -> node id (discovered by the ServerApp before the first round)."""
        if not 1 <= clients_per_round <= len(clients):
            raise ValueError(f"clients_per_round must be in [1, {len(clients)}], got {clients_per_round}")
        self.clients = dict(clients)
        self.clients_per_round = clients_per_round
        self.min_available = len(clients) if min_available is None else min_available
        self.node_wait_s = node_wait_s
        self.seed = seed
        self.round_config = round_config or (lambda _rnd: {})
        self.options = {**self.default_options(), **(options or {})}
        self.check_options(self.options)
        # Where clients keep their state ("disk" mode; a node's own state-dir wins), and the server's
        # own store of every client's state in "server" mode.
        self.state_dir = state_dir or ""
        self.server_store = None
        if self.options["client_state"] == "server":
            if not state_dir:
                raise ValueError("client_state 'server' needs a state directory on the server")
            self.server_store = DiskStateStore(f"{state_dir}/server-side")
            self.server_store.clear()
        # One entry per finished round: what the ServerApp writes to metrics.jsonl.
        self.round_records: dict[int, dict[str, Any]] = {}
        self._round_start: dict[int, float] = {}
        self._bytes_down: dict[int, int] = {}
        self._sent: dict[int, list[Message]] = {}  # each round's messages, to name the clients that failed
        self._upload_spec: dict[int, ArraySpec] = {}  # per round: the "arrays" a reply must carry back
        self.max_reply_bytes = DEFAULT_MAX_REPLY_BYTES
        self.min_replies = 1
        self._validated: set[int] = set()  # ids of replies already found valid (subclasses screen before super())
        self._foreign_nodes: set[int] = set()  # connected nodes that hold none of this experiment's clients
        # The clients' resource figures (their ``res.*`` metrics) per client and per run; summary.json's "resources".
        self.resource_book = ClientResourceBook()
        self.reply_arrivals: dict[str, float] = {}  # reply message id -> when the ServerApp pulled it (epoch s)

    def prepare(self, cfg, data, split) -> None:
        """Called by the ServerApp once before the first round with the experiment config, the data set and
        its federated split (subclasses that train on the server extend it; call super first)."""
        self.cfg = cfg
        self.max_reply_bytes = int(cfg.federation.max_reply_mb * 2**20)
        self.min_replies = int(cfg.federation.min_replies)

    # ------------------------------------------------------------------ what is exchanged
    def exchange_prefixes(self, method) -> tuple[str, ...]:
        """State-dict key prefixes the clients upload and the server averages."""
        return method.shared_prefixes(with_target=bool(self.options["aggregate_target"]))

    def client_config(self, server_round: int) -> dict[str, Any]:
        """Strategy-specific keys added to every client's config (subclasses extend it)."""
        return {
            **code_identity(),  # the clients refuse a message from other code (fedssl_wire.check_same_code)
            "update-both": bool(self.options["update_both"]),
            "aggregate-target": bool(self.options["aggregate_target"]),
            "client-update": self.client_update,
            "client-state": str(self.options["client_state"]),
            "state-dir": self.state_dir,
            "state-run": str(getattr(self, "state_run", "")),
        }

    def config_for_client(self, server_round: int, partition_id: int) -> dict[str, Any]:
        """Keys for one client only (hook: FedEMA sends each client its autoscaler lambda as
        ``rule-input.server_lambda``; ``rule-input.*`` keys reach the client's download rule)."""
        return {}

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self._round_start[server_round] = time.perf_counter()
        available = self.trainable(self.wait_for_clients(grid, server_round))
        chosen = sample_clients(available, min(self.clients_per_round, len(available)), self.seed, server_round)
        payload = self.arrays_for_round(server_round, arrays)
        self._upload_spec[server_round] = array_spec(arrays)
        messages = []
        for pid in chosen:
            node = self.clients[pid]
            cfg = ConfigRecord(
                {
                    **dict(config),
                    **self.round_config(server_round),
                    **self.client_config(server_round),
                    **self.config_for_client(server_round, pid),
                    "server-round": server_round,
                }
            )
            content = RecordDict({"arrays": self.arrays_for_client(server_round, pid, payload), "config": cfg})
            if self.server_store is not None:
                content[CLIENT_STATE_RECORD] = to_array_record(self.server_store.load(pid) or {})
            messages.append(
                Message(content, dst_node_id=node, message_type=self.message_type, group_id=str(server_round))
            )
        self._bytes_down[server_round] = sum(self.payload_bytes(m.content) for m in messages)
        self._sent[server_round] = messages
        log(INFO, "round %d: training on clients %s", server_round, chosen)
        return messages

    def trainable(self, available: list[int]) -> list[int]:
        """The clients that may train (hook: FLESD's client 0 holds the public set and does not train)."""
        return available

    def wait_for_clients(self, grid: Grid, server_round: int) -> list[int]:
        """Partition ids whose nodes are connected, once at least ``min_available`` are (or time runs out); a client
        back under a new node id is taken in (``strategies.nodes.wait_for_partitions``)."""
        return wait_for_partitions(
            grid,
            self.clients,
            min_available=self.min_available,
            wait_s=self.node_wait_s,
            foreign=self._foreign_nodes,
            server_round=server_round,
        )

    def arrays_for_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """The global arrays every client of the round receives (hook for subclasses)."""
        return arrays

    def arrays_for_client(self, server_round: int, partition_id: int, arrays: ArrayRecord) -> ArrayRecord:
        """Per-client payload (hook: FedEMA's cross-device mode sends the client's own state)."""
        return arrays

    # ------------------------------------------------------------------ reply validation
    def expected_reply_arrays(
        self, server_round: int, partition_id: int
    ) -> dict[str, dict[str, tuple[tuple[int, ...], str]]] | None:
        """Record name -> {array name: (shape, dtype)} that a client's reply must carry exactly (hook). The
        averaging strategies: the arrays of the round's global model, which clients upload back (the ServerApp's
        initial record or the last aggregate). None: no exact expectation (the strategy checks its payload in
        ``check_reply_payload``)."""
        spec = self._upload_spec.get(server_round)
        return {"arrays": spec} if spec is not None else None

    def check_reply_payload(self, server_round: int, partition_id: int, reply: Message) -> str | None:
        """A strategy's own check of a reply's payload (hook; FLESD's similarity matrix, Hetero-SSFL's kernel);
        the reason it is unusable, or None."""
        return None

    def validate_reply(self, server_round: int, reply: Message) -> str | None:
        """Why ``reply`` must not be used, or None. Checked before anything of it is used: the metrics (partition id
        of the node it was sent to, example count > 0, a finite loss), the size, the arrays (exactly the expected
        names, shapes and dtypes where the strategy expects them; finite values), then the strategy's own
        payload check (``strategies.replies`` holds the checks)."""
        content = reply.content
        if "metrics" not in content.metric_records:
            return "no metrics record"
        pid = {node: pid for pid, node in self.clients.items()}.get(reply.metadata.src_node_id)
        problem = metrics_problem(content["metrics"], pid) or size_problem(content, self.max_reply_bytes)
        if problem:
            return problem
        pid = cast(int, pid)  # metrics_problem: the reply's int partition-id is the node's client
        try:
            return arrays_problem(content, self.expected_reply_arrays(server_round, pid)) or self.check_reply_payload(
                server_round, pid, reply
            )
        except ValueError as exc:  # a packed record whose manifest and buffer disagree
            return str(exc)

    def screen_replies(self, server_round: int, replies: list) -> list:
        """The round's replies with every invalid one replaced by a ``RejectedReply`` (logged with node, client and
        reason); stops the run if a client runs other code or fewer than ``federation.min_replies`` valid replies
        remain (``strategies.replies.screen_replies``)."""
        return screen_replies(
            replies,
            server_round=server_round,
            problem=lambda r: self.validate_reply(server_round, r),
            already_valid=self._validated,
            partition_of_node={node: pid for pid, node in self.clients.items()},
            min_replies=self.min_replies,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = self.screen_replies(server_round, list(replies))
        self._validated.clear()
        ok = [r for r in replies if not r.has_error()]
        failed = self.failed_clients(server_round, replies)
        for f in failed:
            log(WARNING, "round %d: client %s failed: %s", server_round, f["id"], f["reason"])
        clients = [self.client_record(r) for r in ok]
        self.account_resources(clients)
        bytes_up = sum(self.payload_bytes(r.content) for r in ok)
        if self.server_store is not None:
            for r, c in zip(ok, clients):
                self.server_store.save(c["id"], from_array_record(r.content[CLIENT_STATE_RECORD]))
        aggregated = None
        if ok:
            aggregated = self.aggregate(server_round, ok, clients)
        else:
            log(WARNING, "round %d: no client replied successfully; the global model is unchanged", server_round)
        loss = weighted_mean([c["loss"] for c in clients], [c["num_examples"] for c in clients])
        self.round_records[server_round] = {
            "round": server_round,
            "train_loss": loss,
            "bytes_up": bytes_up,
            "bytes_down": self._bytes_down.get(server_round, 0),
            "num_clients": len(ok),
            "num_failed": len(failed),
            "failed_clients": failed,
            "num_examples": int(sum(c["num_examples"] for c in clients)),
            "client_train_s_max": max((c["train_s"] for c in clients), default=0.0),
            "clients": clients,
        }
        metrics = MetricRecord({"train_loss": loss, "num-examples": self.round_records[server_round]["num_examples"]})
        return aggregated, metrics

    def failed_clients(self, server_round: int, replies: list[Message]) -> list[dict[str, Any]]:
        """The clients of the round without a successful reply, with the reason: an error reply (a crashed
        ClientApp, or "Node Unavailable" when a SuperNode stopped sending heartbeats) or no reply in time."""
        sent = self._sent.pop(server_round, [])
        pid_of_node = {node: pid for pid, node in self.clients.items()}
        pid_of_message = {
            m.metadata.message_id: pid_of_node.get(m.metadata.dst_node_id)
            for m in sent
            if getattr(m.metadata, "message_id", "")
        }  # ids: set when pushed
        answered = {int(r.content["metrics"]["partition-id"]) for r in replies if not r.has_error()}  # type: ignore[arg-type]  # an int
        failed: dict[Any, str] = {}
        for r in replies:
            if r.has_error():
                pid = pid_of_message.get(r.metadata.reply_to_message_id)
                if pid is None:  # no message id to match (not pushed through a SuperLink): the sending node's client
                    pid = pid_of_node.get(r.metadata.src_node_id)
                failed[pid if pid is not None else f"node {r.metadata.src_node_id}"] = readable_reason(r.error.reason)
        for m in sent:
            pid = pid_of_node.get(m.metadata.dst_node_id)
            if pid is not None and pid not in answered and pid not in failed:
                failed[pid] = "no reply before the round timeout (federation.round_timeout_s)"
        return [{"id": pid, "reason": reason} for pid, reason in failed.items()]

    def models_to_evaluate(self, arrays: ArrayRecord) -> Mapping[str, ModelToEvaluate]:
        """The encoders the server scores, by name: the global model (Min-Local scores every client's own)."""
        return {"global": ModelToEvaluate(self.cfg.model.arch, arrays)}

    def traffic(self, model_bytes: int) -> str:
        """What travels each round, in words, for the first progress line (``model_bytes``: the initial global
        arrays' size). Strategies that send something else say so (FLESD, Hetero-SSFL, Min-Local, central)."""
        extra = " (+ the averaged target with aggregate_target)" if self.options.get("aggregate_target") else ""
        return f"down and up per client and round: the model, {model_bytes / 2**20:.2f} MiB{extra}"

    # ------------------------------------------------------------------ the rounds
    def run_rounds(
        self,
        grid: Grid,
        arrays: ArrayRecord,
        *,
        first_round: int,
        num_rounds: int,
        timeout: float,
        train_config: ConfigRecord,
        after_round: Callable[[int, ArrayRecord], Any],
    ) -> ArrayRecord:
        """Rounds ``first_round`` .. ``num_rounds`` as Flower's ``Strategy.start`` runs them (train, aggregate,
        client-side evaluation, then ``after_round`` with the global arrays), but able to start after round 1: a
        resumed run continues with the round after its checkpoint (``Strategy.start`` has no start round).
        Returns the final global arrays."""
        log(INFO, "Starting %s strategy at round %d of %d", type(self).__name__, first_round, num_rounds)
        self.summary()
        evaluate_config = ConfigRecord()
        for server_round in range(first_round, num_rounds + 1):
            log(INFO, "[ROUND %s/%s]", server_round, num_rounds)
            self.reply_arrivals.clear()  # a refused reply's arrival is never looked up
            replies = send_and_receive(
                grid,
                self.configure_train(server_round, arrays, train_config, grid),
                timeout,
                arrivals=self.reply_arrivals,
            )
            new_arrays, _ = self.aggregate_train(server_round, replies)
            if new_arrays is not None:
                arrays = new_arrays
            evaluate_replies = send_and_receive(
                grid, self.configure_evaluate(server_round, arrays, evaluate_config, grid), timeout
            )
            self.aggregate_evaluate(server_round, evaluate_replies)
            after_round(server_round, arrays)
        return arrays

    # ------------------------------------------------------------------ checkpoints (server_app/checkpoint.py)
    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, str]]:
        """What a checkpoint must hold to resume this strategy exactly: (plain JSON-able state, arrays, on-disk
        stores by name -> folder). Subclasses extend all three (call super)."""
        stores = {"server-side": str(self.server_store.root)} if self.server_store is not None else {}
        return (
            {"client_resources": copy.deepcopy(self.resource_book.totals), "bytes_totals": self.bytes_totals()},
            {},
            stores,
        )

    def restore_state(self, plain: dict[str, Any], arrays: dict[str, np.ndarray], stores: dict[str, str]) -> None:
        """Undo ``checkpoint_state`` after ``prepare`` (``stores``: name -> the checkpoint's snapshot folder)."""
        if self.server_store is not None and "server-side" in stores:
            self.server_store.replace_with(stores["server-side"])
        if "client_resources" in plain:
            self.resource_book = ClientResourceBook(plain["client_resources"])
        self._bytes_before = dict(plain.get("bytes_totals", {"up": 0, "down": 0}))

    def bytes_totals(self) -> dict[str, int]:
        """Bytes up and down of the whole run so far: the rounds before a resume (from its checkpoint) and this
        process's rounds."""
        before = getattr(self, "_bytes_before", {"up": 0, "down": 0})
        return {
            "up": int(before["up"] + sum(r["bytes_up"] for r in self.round_records.values())),
            "down": int(before["down"] + sum(r["bytes_down"] for r in self.round_records.values())),
        }

    def summary_extras(self, scores_by_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Strategy-specific entries of summary.json. With per-client models (``client_<i>``), their scores grouped
        by architecture: mean, minimum and count of each score per architecture."""
        by_arch: dict[str, dict[str, list[float]]] = {}
        for name, scores in scores_by_model.items():
            if not name.startswith("client_") or not name[len("client_") :].isdigit():
                continue
            arch = self.cfg.client_arch(int(name[len("client_") :]))
            for key, value in scores.items():
                if value is not None:
                    by_arch.setdefault(arch, {}).setdefault(key, []).append(float(value))
        extras: dict[str, Any] = {"resources": self.resource_summary()}
        if not by_arch:
            return extras
        return {
            **extras,
            "scores_by_arch": {
                arch: {
                    **{f"{k}_mean": sum(v) / len(v) for k, v in keys.items()},
                    **{f"{k}_min": min(v) for k, v in keys.items()},
                    "num_clients": max(len(v) for v in keys.values()),
                }
                for arch, keys in sorted(by_arch.items())
            },
        }

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]) -> ArrayRecord | None:
        """The new global arrays from the successful replies: the example-weighted average (None in a strategy
        without a global model: Local, Hetero-SSFL)."""
        states = [from_array_record(cast(ArrayRecord, r.content["arrays"])) for r in replies]
        return to_array_record(weighted_average(states, [c["num_examples"] for c in clients]))

    @staticmethod
    def payload_bytes(content: RecordDict) -> int:
        """Bytes of the arrays a message carries (model parts, and client state in "server" mode)."""
        return sum(record_bytes(rec) for rec in content.array_records.values())

    def client_record(self, reply: Message) -> dict[str, Any]:
        """Per-client facts of one reply, for metrics.jsonl; ``rule.*`` metrics (what the client's
        download rule did: FedEMA's mu and divergence, FedU's predictor switch) and ``res.*`` metrics (its FLOPs,
        memory and peak RSS) are added without their prefix."""
        m: Mapping[str, Any] = reply.content["metrics"]  # a MetricRecord: numbers
        record: dict[str, Any] = {
            "id": int(m["partition-id"]),
            "loss": float(m["train_loss"]),
            "num_examples": int(m["num-examples"]),
            "train_s": float(m["train_s"]),
            "bytes_up": self.payload_bytes(reply.content),
        }
        for key in m:
            for prefix in ("rule.", "res."):  # what the download rule did; the client's resource figures
                if key.startswith(prefix):
                    record[key[len(prefix) :]] = m[key]
            if key.startswith("precision."):  # what the local steps ran in: fp32, bf16 or fp16
                record["precision"] = key[len("precision.") :]
        # Where the round ran: the host (and Ray node), the device it trained on and why, the machine's GPU count.
        where = reply.content.config_records.get("client-info")
        if where is not None:
            record.update(
                {key.replace("-", "_"): where[key] if isinstance(where[key], int) else str(where[key]) for key in where}
            )
        timeline = client_timeline(m, self.reply_arrivals.pop(reply.metadata.message_id, None))
        if timeline:
            record["timeline_s"] = timeline
        return record

    @property
    def client_resources(self) -> dict[str, Any]:
        """The resource book's per-client and per-run totals (``strategies.resources``)."""
        return self.resource_book.totals

    def account_resources(self, clients: list[dict[str, Any]]) -> None:
        """Add one round's client records to the run's resource book (``ClientResourceBook.add_round``)."""
        self.resource_book.add_round(clients)

    def resource_summary(self) -> dict[str, Any]:
        """summary.json's "resources": the clients' figures, with the run's bytes both ways (a resumed run's too)."""
        totals = self.bytes_totals()
        return self.resource_book.summary(bytes_up=totals["up"], bytes_down=totals["down"])

    def round_wall_s(self, server_round: int) -> float:
        start = self._round_start.get(server_round)
        return time.perf_counter() - start if start is not None else float("nan")

    # ------------------------------------------------------------------ evaluate (server-side only)
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return []  # evaluation runs on the server (kNN monitor, linear probe)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        log(
            INFO,
            "\t%s: %d clients, %d per round, seed %d, options %s",
            type(self).__name__,
            len(self.clients),
            self.clients_per_round,
            self.seed,
            self.options,
        )
