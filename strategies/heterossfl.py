"""Hetero-SSFL (Makhija et al., "Federated Self-supervised Learning for Heterogeneous Clients").

There is no global model. Every client keeps its own encoder, of its own architecture (``model.client_archs`` or
drawn from ``model.client_arch_pool``), and its own weights for the whole run, in its client state. What travels
is kernels on the Representation Alignment Dataset (RAD: the server-held split of ``data.public_size`` images,
never part of a client's partition, rebuilt by every client from the config and checked by its SHA-256):

- **before round 1** (``initial_kernels: query``, Algorithm 1's K_bar(0)): a ``query.kernel`` message asks every
  connected client for the kernel of its initial model, so round 1 aligns too; ``initial_kernels: none`` skips it
  (round 1 is then local SSL only);
- **down**, with every training message: ``K_bar = sum_j w_j K_j`` over the latest kernel of every client that
  has uploaded one (Algorithm 1 averages all clients' kernels; under partial participation the server keeps each
  client's latest kernel on its disk and streams them from there, so its memory does not grow with the number
  of clients). With ``kernel_normalization: frobenius`` (the default) each client's centred kernel enters with
  norm 1, so uniform weights weigh clients equally (the paper's w = 1/n);
- **up**: the client's ``K_k = A_k A_k^T`` of its RAD representations after local training on
  ``SSL loss + mu (1 - CKA(K_k, K_bar))`` (``client_app.rounds.kernel.kernel_round``), and its raw ``||H K_k H||_F``
  (``kernel_norm`` in metrics.jsonl).

N_RAD^2 values each way per client and round, whatever the model size. To score the clients' personalised
encoders the server asks for them with a separate ``query.encoder`` message at kNN-monitor rounds and after
the last round (only clients that have trained); those bytes are recorded apart (``eval_bytes_up``), not in
the round's ``bytes_up``/``bytes_down``. The encoders are kept on the server's disk and read back one at a
time for evaluation.

Math: ``ssl_models/federated/cka.py`` (CKA, the loss) and ``ssl_models/federated/kernel_alignment.py`` (kernels,
transport, the streaming average, the local alignment term).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Mapping
from logging import INFO, WARNING
from typing import Any, cast

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from fedssl_wire import (
    CLIENT_STATE_RECORD,
    ENCODER_QUERY_MESSAGE_TYPE,
    KERNEL_MESSAGE_TYPE,
    KERNEL_QUERY_MESSAGE_TYPE,
    KERNEL_RECORD,
    DiskStateStore,
    from_array_record,
    record_bytes,
    to_array_record,
)
from ssl_models.data.splits import images_digest, public_images
from ssl_models.federated.kernel_alignment import (
    BN_MODES,
    KERNEL_FUNCTIONS,
    KERNEL_NORMALIZATIONS,
    KERNEL_WEIGHTS,
    RAD_PRECISIONS,
    REFRESH_MODES,
    REPRESENTATIONS,
    average_kernels,
    check_kernel_payload,
    encode_kernel,
)
from ssl_models.federated.similarity import ENCODING_MODES, TOPK

from .fedssl import FedSSL, ModelToEvaluate
from .nodes import send_and_receive
from .options import check_choice, check_positive, check_unit

META_ROUND = "meta.round"
META_EXAMPLES = "meta.num_examples"
INITIAL_KERNELS = ("query", "none")


class StoredEncoders(Mapping):
    """The clients' encoders the server fetched, read from its disk one at a time (``name -> ModelToEvaluate``)."""

    def __init__(self, store: DiskStateStore, archs: dict[int, str]) -> None:
        self.store, self.archs = store, dict(sorted(archs.items()))

    def __getitem__(self, name: str) -> ModelToEvaluate:
        pid = int(name[len("client_") :]) if name.startswith("client_") and name[len("client_") :].isdigit() else None
        state = self.store.load(pid) if pid is not None and pid in self.archs else None
        if pid is None or state is None:
            raise KeyError(name)
        return ModelToEvaluate(self.archs[pid], to_array_record(state))

    def __iter__(self) -> Iterator[str]:
        return (f"client_{pid}" for pid in self.archs)

    def __len__(self) -> int:
        return len(self.archs)


class HeteroSSFL(FedSSL):
    name = "heterossfl"
    client_update = "heterossfl"
    supports_mixed_archs = True
    target_options = False  # clients exchange kernels, never weights: no target branch to send or receive
    message_type = KERNEL_MESSAGE_TYPE

    @classmethod
    def default_options(cls) -> dict[str, Any]:
        return {
            **super().default_options(),
            "mu": 0.5,  # weight of the alignment term (the paper: 0.5 CIFAR, 1 Tiny-ImageNet)
            "representation": "predictor",  # predictor (the paper) | projector | backbone
            "kernel": "linear",  # linear: K = A A^T (the paper) | rbf
            "rbf_threshold": 0.5,  # RBF bandwidth: threshold x median distance
            "kernel_encoding": "dense-fp32",  # dense-fp32 | dense-fp16 | topk (FLESD's top-n% rows), both ways
            "topk_fraction": 0.1,  # kernel_encoding topk: fraction of each row kept, in (0, 1] (floor(f N) + 1 entries)
            "kernel_weights": "uniform",  # uniform | data_size (w_j proportional to client j's images)
            # frobenius: each client scales its kernel to ||H K H||_F = 1 before upload, so uniform weights weigh
            # clients equally (CKA is scale-free) | none: raw K = A A^T (larger representations weigh more)
            "kernel_normalization": "frobenius",
            # when A_k and the term are recomputed (ssl_models/federated/kernel_alignment.py): step (every
            # refresh_steps steps on the whole RAD; 1 = Eq. 2 at the current weights) | minibatch (every step on
            # rad_batch_size RAD images) | epoch (once per local epoch, the gradient held in between)
            "refresh": "step",
            "refresh_steps": 1,  # refresh: step
            "rad_batch_size": 256,  # refresh: minibatch
            # BatchNorm in RAD forwards: train (each forward's batch statistics, as the SSL steps and FedHeNN's
            # in-loop representations use; the running ones untouched) | eval (the running statistics, which the
            # SSL steps move and the alignment gradient cannot reach)
            "bn_mode": "train",
            # the network part of the term's RAD forwards: train (the local step's precision: bf16 autocast and
            # channels-last on the fast path) | fp32; the kernel, CKA and uploaded kernels are float32 either way
            "rad_precision": "train",
            "initial_kernels": "query",  # query: K_bar(0) from the initial models (Algorithm 1) | none
            "rad_forward_batch": 256,  # RAD images per forward chunk (memory, not maths)
            "eval_query_batch": 10,  # clients asked for their encoder per message batch at evaluation rounds
        }

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        super().check_options(options)
        check_choice(options, "representation", REPRESENTATIONS)
        check_choice(options, "kernel", KERNEL_FUNCTIONS)
        check_choice(options, "kernel_encoding", ENCODING_MODES)
        check_choice(options, "kernel_weights", KERNEL_WEIGHTS)
        check_choice(options, "kernel_normalization", KERNEL_NORMALIZATIONS)
        check_choice(options, "refresh", REFRESH_MODES)
        check_choice(options, "bn_mode", BN_MODES)
        check_choice(options, "rad_precision", RAD_PRECISIONS)
        check_choice(options, "initial_kernels", INITIAL_KERNELS)
        if not options["mu"] >= 0:
            raise ValueError(f"strategy.options.mu: must be >= 0 (got {options['mu']!r})")
        check_unit(options, "topk_fraction")
        for key in (
            "topk_fraction",
            "rbf_threshold",
            "refresh_steps",
            "rad_batch_size",
            "rad_forward_batch",
            "eval_query_batch",
        ):
            check_positive(options, key)
        if options["rad_batch_size"] < 4:
            raise ValueError(
                f"strategy.options.rad_batch_size: must be >= 4 (a CKA needs n > 3), got {options['rad_batch_size']!r}"
            )

    @classmethod
    def check_config(cls, cfg) -> None:
        if not cfg.data.public_size:
            raise ValueError(
                "data.public_size: Hetero-SSFL needs the RAD (representation alignment dataset), the "
                "server-held split: set a count (the paper: 5000) or a fraction"
            )

    # ------------------------------------------------------------------ setup
    def prepare(self, cfg, data, split) -> None:
        super().prepare(cfg, data, split)
        rad = public_images(cfg, data)
        self.rad_size = len(rad)
        self.rad_digest = images_digest(rad)
        del rad  # the server needs only the digest: clients compute the kernels
        self.init_kernel_store(self.rad_size)
        self.encoders = DiskStateStore(f"{self.state_dir or '.'}/server-encoders")  # fetched encoders, for evaluation
        self.encoders.clear()
        self.trained: dict[int, int] = {}  # pid -> rounds trained (successful replies)
        self.fetched: dict[int, str] = {}  # pid -> arch of the encoders held in self.encoders
        self.eval_bytes: dict[int, int] = {}
        # Each client's image count (data_size kernel weights for K_bar(0), before any client has reported it).
        self.num_examples = {pid: len(idx) for pid, idx in enumerate(split.client_idx)} if split is not None else {}
        log(
            INFO,
            "Hetero-SSFL RAD: %d images, sha256 %s; client architectures %s",
            self.rad_size,
            self.rad_digest[:16],
            [cfg.client_arch(i) for i in range(cfg.federation.num_clients)],
        )

    def traffic(self, model_bytes: int) -> str:
        n = self.rad_size
        first = (
            "before round 1 each client's kernel of its initial model (K_bar(0))"
            if self.options["initial_kernels"] == "query"
            else "from round 2"
        )
        return (
            f"no weights: up, the client's {n} x {n} RAD kernel ({self.options['kernel_encoding']}); down, "
            f"K_bar of the same size ({first}); each client's encoder travels up only for evaluation"
        )

    def init_kernel_store(self, rad_size: int) -> None:
        """An empty store of the clients' kernels for a RAD of ``rad_size`` images (each client's latest kernel,
        one file per client under ``<state_dir>/server-kernels``), and no K_bar yet."""
        self.rad_size = rad_size
        self.kernels = DiskStateStore(f"{self.state_dir or '.'}/server-kernels")
        self.kernels.clear()
        self.kernel_info: dict[int, dict[str, int]] = {}  # pid -> {"round", "num_examples"} (small, in memory)
        self.kbar_record = ArrayRecord()  # K_bar in transport form; empty before the first kernels
        self.kbar_clients: list[int] = []
        self._kbar_stats: dict[int, dict[str, Any]] = {}
        self._initial: dict[str, Any] = {}  # the K_bar(0) query's figures, for round 1's record

    def store_kernel(self, pid: int, payload: Mapping[str, np.ndarray], server_round: int, num_examples: int) -> None:
        """Keep ``payload`` (an ``encode_kernel`` payload) as client ``pid``'s latest kernel, on disk."""
        payload = dict(payload)
        check_kernel_payload(payload, self.rad_size)
        payload[META_ROUND] = _scalar(server_round)
        payload[META_EXAMPLES] = _scalar(num_examples)
        self.kernels.save(pid, payload)
        self.kernel_info[pid] = {"round": int(server_round), "num_examples": int(num_examples)}

    def update_kbar(self) -> None:
        """K_bar over the latest kernel of every client, streamed from disk one kernel at a time, kept only in
        its transport form (``kbar_record``)."""
        kbar = average_kernels(self._stored_kernels(), self.rad_size)
        encoding = str(self.options["kernel_encoding"])
        fraction = float(self.options["topk_fraction"]) if encoding == TOPK else None
        self.kbar_record = to_array_record(encode_kernel(kbar, encoding, fraction))
        self.kbar_clients = sorted(self.kernel_info)

    def exchange_prefixes(self, method) -> tuple[str, ...]:
        return ()  # no global model: no weights travel in training rounds

    def client_config(self, server_round: int) -> dict[str, Any]:
        return {**super().client_config(server_round), "rad-digest": self.rad_digest}

    def arrays_for_round(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """K_bar (empty in round 1: no client has uploaded a kernel yet)."""
        return self.kbar_record

    def configure_train(self, server_round, arrays, config, grid):
        if server_round == 1 and not self.kernel_info and self.options["initial_kernels"] == "query":
            self.query_initial_kernels(self.wait_for_clients(grid, server_round), grid)
        self._kbar_stats[server_round] = {
            "kbar_clients": len(self.kbar_clients),
            "kbar_bytes_per_client": record_bytes(self.kbar_record),
        }
        return super().configure_train(server_round, arrays, config, grid)

    # ------------------------------------------------------------------ kernels
    def query_clients(
        self, grid: Grid, server_round: int, pids: list[int], message_type: str, group: str
    ) -> Iterator[tuple[int | None, Message | None]]:
        """Send ``message_type`` (a query: no training) to the clients ``pids``, ``eval_query_batch`` at a time, and
        yield (partition id, reply) as replies arrive (id None for an error reply); a client that does not answer
        in time yields (pid, None)."""
        batch = int(self.options["eval_query_batch"])
        for start in range(0, len(pids), batch):
            chunk = [pid for pid in pids[start : start + batch] if pid in self.clients]
            messages = []
            for pid in chunk:
                content = RecordDict(
                    {
                        "config": ConfigRecord(
                            {
                                "experiment": self.cfg.to_json(),
                                "server-round": server_round,
                                **self.client_config(server_round),
                            }
                        )
                    }
                )
                if self.server_store is not None:
                    content[CLIENT_STATE_RECORD] = to_array_record(self.server_store.load(pid) or {})
                messages.append(
                    Message(content, dst_node_id=self.clients[pid], message_type=message_type, group_id=group)
                )
            answered = set()
            for reply in send_and_receive(grid, messages, self.cfg.federation.round_timeout_s):
                if reply.has_error():
                    yield None, reply
                    continue
                pid = int(reply.content["metrics"]["partition-id"])  # type: ignore[arg-type]  # an int
                answered.add(pid)
                yield pid, reply
            for pid in chunk:
                if pid not in answered:
                    yield pid, None

    def query_initial_kernels(self, pids: list[int], grid: Grid) -> None:
        """K_bar(0) (Algorithm 1): every connected client's kernel of its initial model, before round 1 trains.
        A client that fails here trains round 1 against the K_bar of the others (or with none at all)."""
        t0 = time.perf_counter()
        up, norms, failed = 0, {}, []
        for pid, reply in self.query_clients(grid, 0, sorted(pids), KERNEL_QUERY_MESSAGE_TYPE, "initial-kernels"):
            if reply is None or reply.has_error():
                reason = reply.error.reason if reply is not None else "no reply"
                if "public set mismatch" in (reason or ""):  # a client on another RAD would poison K_bar
                    raise RuntimeError(f"initial kernels: {reason}")
                failed.append({"id": pid, "reason": reason})
                continue
            reason = self.check_reply_payload(0, pid, reply)
            if reason is not None:
                failed.append({"id": pid, "reason": reason})
                continue
            assert pid is not None  # a reply without error names its client
            kernel = cast(ArrayRecord, reply.content[KERNEL_RECORD])
            up += record_bytes(kernel)
            self.store_kernel(pid, from_array_record(kernel), 0, max(1, self.num_examples.get(pid, 1)))
            norms[str(pid)] = float(reply.content["metrics"]["align.kernel_norm"])  # type: ignore[arg-type]  # a float
        for f in failed:
            log(WARNING, "initial kernels: client %s gave none (%s)", f["id"], f["reason"])
        if self.kernel_info:
            self.update_kbar()
        self._initial = {
            "initial_kernel_clients": len(norms),
            "initial_kernel_bytes_up": up,
            "initial_kernel_norms": norms,
            "initial_kernel_s": time.perf_counter() - t0,
            **({"initial_kernel_failed": failed} if failed else {}),
        }
        log(
            INFO,
            "K_bar(0) from %d initial kernels (%.1f s); kernel norms ||HKH||_F %s",
            len(norms),
            self._initial["initial_kernel_s"],
            {k: round(v, 3) for k, v in norms.items()},
        )

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]) -> None:
        """Keep each client's new kernel on disk, then form the next K_bar over the latest kernel of every
        client. Returns None: there is no global model."""
        for reply, client in zip(replies, clients):
            self.store_kernel(
                client["id"],
                from_array_record(cast(ArrayRecord, reply.content[KERNEL_RECORD])),
                server_round,
                client["num_examples"],
            )
            self.trained[client["id"]] = self.trained.get(client["id"], 0) + 1
        t0 = time.perf_counter()
        self.update_kbar()
        self._kbar_stats.setdefault(server_round, {}).update(
            kernel_average_s=time.perf_counter() - t0,
            kernels_stored=len(self.kernel_info),
            kernel_store_mib=self.kernels.size_bytes() / 2**20,
        )

    def _stored_kernels(self) -> Iterable[tuple[dict, float]]:
        """(payload, weight) of every client's latest kernel, read from disk one at a time."""
        for pid in sorted(self.kernel_info):
            payload = self.kernels.load(pid)
            assert payload is not None  # kernel_info lists the stored kernels
            weights_by_size = self.options["kernel_weights"] == "data_size"
            weight = float(self.kernel_info[pid]["num_examples"]) if weights_by_size else 1.0
            yield {k: v for k, v in payload.items() if not k.startswith("meta.")}, weight

    def checkpoint_state(self):
        plain, arrays, stores = super().checkpoint_state()
        plain = {
            **plain,
            "kernel_info": {str(k): v for k, v in self.kernel_info.items()},
            "trained": {str(k): v for k, v in self.trained.items()},
            "fetched": {str(k): v for k, v in self.fetched.items()},
            "eval_bytes": {str(k): v for k, v in self.eval_bytes.items()},
        }
        return (
            plain,
            arrays,
            {**stores, "server-kernels": str(self.kernels.root), "server-encoders": str(self.encoders.root)},
        )

    def restore_state(self, plain, arrays, stores) -> None:
        super().restore_state(plain, arrays, stores)
        self.kernels.replace_with(stores["server-kernels"])
        self.encoders.replace_with(stores["server-encoders"])
        self.kernel_info = {int(k): dict(v) for k, v in plain["kernel_info"].items()}
        self.trained = {int(k): int(v) for k, v in plain["trained"].items()}
        self.fetched = {int(k): str(v) for k, v in plain["fetched"].items()}
        self.eval_bytes = {int(k): int(v) for k, v in plain["eval_bytes"].items()}
        if self.kernel_info:
            self.update_kbar()

    def expected_reply_arrays(self, server_round, partition_id):
        return None  # no weights come back: the kernel payload is checked in check_reply_payload

    def check_reply_payload(self, server_round, partition_id, reply):
        if KERNEL_RECORD not in reply.content.array_records:
            return f"no {KERNEL_RECORD!r} record"
        try:
            check_kernel_payload(from_array_record(reply.content[KERNEL_RECORD]), self.rad_size)
        except ValueError as exc:
            return f"kernel payload: {exc}"
        return None

    def aggregate_train(self, server_round, replies):
        replies = self.screen_replies(server_round, list(replies))
        for r in replies:  # a client on another RAD would poison K_bar: stop the run
            if r.has_error() and "public set mismatch" in r.error.reason:
                raise RuntimeError(f"round {server_round}: {r.error.reason}")
        arrays, metrics = super().aggregate_train(server_round, replies)
        record = self.round_records.get(server_round)
        if record is not None:
            ok = [r for r in replies if not r.has_error()]
            record.update(
                rad_size=self.rad_size,
                **self._kbar_stats.pop(server_round, {}),
                kernel_bytes_up=sum(record_bytes(r.content[KERNEL_RECORD]) for r in ok),
            )
            if self._initial:  # round 1: the K_bar(0) query's kernels travelled up too
                record.update(self._initial)
                record["bytes_up"] += int(self._initial["initial_kernel_bytes_up"])
                self._initial = {}
        return arrays, metrics

    def client_record(self, reply: Message) -> dict[str, Any]:
        record = super().client_record(reply)
        record["arch"] = self.cfg.client_arch(record["id"])
        m = reply.content["metrics"]
        for key in m:
            if key.startswith("align."):
                record[key[len("align.") :]] = m[key]
        return record

    # ------------------------------------------------------------------ evaluation: fetch the clients' encoders
    def is_eval_round(self, server_round: int) -> bool:
        every = self.cfg.eval.knn_every
        return server_round == self.cfg.rounds or bool(every and server_round % every == 0)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """At kNN rounds and after the last round, fetch the encoder of every client that has trained (to the
        server's disk). Sent here, in batches, rather than returned: the replies are written to disk batch by
        batch, so the server never holds more than ``eval_query_batch`` encoders."""
        if self.is_eval_round(server_round) and self.trained:
            self.fetch_encoders(server_round, grid)
        return []

    def fetch_encoders(self, server_round: int, grid: Grid) -> None:
        t0 = time.perf_counter()
        pids = sorted(self.trained)
        up = 0
        failed: list[dict[str, Any]] = []
        pid: int | None  # None: with an error reply (query_clients)
        if self.server_store is not None:  # the server holds every client's state already: nothing to send
            for pid in pids:
                state = self.server_store.load(pid) or {}
                self.encoders.save(pid, {k: v for k, v in state.items() if k.startswith("backbone.")})
                self.fetched[pid] = self.cfg.client_arch(pid)
        else:
            for pid, reply in self.query_clients(
                grid, server_round, pids, ENCODER_QUERY_MESSAGE_TYPE, f"eval-{server_round}"
            ):
                if reply is None:
                    failed.append({"id": pid, "reason": "no encoder reply"})
                elif reply.has_error():
                    failed.append({"node": reply.metadata.src_node_id, "reason": reply.error.reason})
                else:
                    assert pid is not None  # a reply without error names its client
                    encoder = cast(ArrayRecord, reply.content["arrays"])
                    up += record_bytes(encoder)
                    self.encoders.save(pid, from_array_record(encoder))
                    self.fetched[pid] = self.cfg.client_arch(pid)
        for f in failed:
            log(
                WARNING,
                "round %d: encoder query failed (%s); its last fetched encoder, if any, is scored",
                server_round,
                f,
            )
        self.eval_bytes[server_round] = up
        record = self.round_records.setdefault(server_round, {"round": server_round})
        record.update(
            eval_bytes_up=up,
            eval_clients=len(pids) - len(failed),
            eval_fetch_s=time.perf_counter() - t0,
            **({"eval_failed": failed} if failed else {}),
        )

    def models_to_evaluate(self, arrays: ArrayRecord) -> Mapping[str, ModelToEvaluate]:
        """Every fetched client encoder (``client_<i>``, its own architecture), read lazily from disk."""
        if not self.fetched:
            raise RuntimeError(
                "Hetero-SSFL has no client encoder to evaluate (no client has trained, or every encoder query failed)"
            )
        return StoredEncoders(self.encoders, self.fetched)

    def summary_extras(self, scores_by_model: dict[str, dict[str, Any]]) -> dict[str, Any]:
        n = self.cfg.federation.num_clients
        return {
            **super().summary_extras(scores_by_model),
            "client_archs": [self.cfg.client_arch(i) for i in range(n)],
            "rounds_trained_by_client": {str(i): self.trained.get(i, 0) for i in range(n)},
            "never_trained": [i for i in range(n) if i not in self.trained],
            "eval_bytes_up_total": int(sum(self.eval_bytes.values())),
            "rad_size": self.rad_size,
            "heterossfl": {
                **{
                    key: self.options[key]
                    for key in (
                        "mu",
                        "representation",
                        "kernel",
                        "kernel_encoding",
                        "kernel_weights",
                        "refresh",
                        "refresh_steps",
                        "rad_batch_size",
                        "kernel_normalization",
                        "bn_mode",
                        "rad_precision",
                        "initial_kernels",
                    )
                },
                "alignment": "1 - linear CKA (the paper's Eq. 2 adds CKA; see the method's page)",
                "round_1": (
                    "aligned to K_bar(0) of the initial models"
                    if self.options["initial_kernels"] == "query"
                    else "local SSL only (no kernel yet)"
                ),
            },
        }


def _scalar(value: int) -> np.ndarray:
    return np.array([int(value)], dtype=np.int64)
