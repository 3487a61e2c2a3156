"""Min-Local: the no-collaboration baseline of the FLESD paper (and the local-SSL rows of Hetero-SSFL's Table 4).
Every client trains only its own model on its own data; nothing is aggregated. The clients start from one shared
initial model (sent once; clients of another architecture than ``model.arch``, ``model.client_archs``, build the
same seeded initial model of their own architecture) and upload their model each round for evaluation only; the
server keeps the latest one per client on disk and reports each client's accuracy and their minimum
("Min-Local") and mean."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from flwr.app import ArrayRecord, Message

from fedssl_wire import DiskStateStore, from_array_record, to_array_record

from .fedssl import FedSSL, ModelToEvaluate


class Local(FedSSL):
    name = "local"
    client_update = "local"
    target_options = False  # nothing is aggregated: every client keeps its whole model
    supports_mixed_archs = True  # no averaging: each client trains its own encoder (local SSL baseline of Hetero-SSFL)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.started: set[int] = set()
        self.models = DiskStateStore(f"{self.state_dir or '.'}/local-models")
        self.models.clear()

    def arrays_for_client(self, server_round: int, partition_id: int, arrays: ArrayRecord) -> ArrayRecord:
        if partition_id in self.started:
            return ArrayRecord()  # nothing to download: the client continues its own model
        self.started.add(partition_id)
        cfg = getattr(self, "cfg", None)
        if cfg is not None and cfg.client_arch(partition_id) != cfg.model.arch:
            return ArrayRecord()  # another architecture: the client builds its own seeded initial model
        return arrays  # the shared initial model, once

    def checkpoint_state(self):
        plain, arrays, stores = super().checkpoint_state()
        return {**plain, "started": sorted(self.started)}, arrays, {**stores, "local-models": str(self.models.root)}

    def restore_state(self, plain, arrays, stores) -> None:
        super().restore_state(plain, arrays, stores)
        self.started = {int(p) for p in plain.get("started", [])}
        self.models.replace_with(stores["local-models"])

    def expected_reply_arrays(self, server_round, partition_id):
        cfg = getattr(self, "cfg", None)
        if cfg is not None and cfg.client_arch(partition_id) != cfg.model.arch:
            return None  # a model of its own architecture: only finite values and the size are checked
        return super().expected_reply_arrays(server_round, partition_id)

    def traffic(self, model_bytes: int) -> str:
        return (
            f"down: the initial model ({model_bytes / 2**20:.2f} MiB) once per client; up: each client's model "
            "every round, for the server's evaluation only (nothing is aggregated)"
        )

    def aggregate(self, server_round: int, replies: list[Message], clients: list[dict[str, Any]]) -> None:
        for reply, client in zip(replies, clients):
            self.models.save(client["id"], from_array_record(cast(ArrayRecord, reply.content["arrays"])))
        # no aggregation: there is no global model

    def models_to_evaluate(self, arrays: ArrayRecord) -> Mapping[str, ModelToEvaluate]:
        out = {}
        for pid in sorted(self.clients):
            state = self.models.load(pid)
            if state is not None:
                out[f"client_{pid}"] = ModelToEvaluate(self.cfg.client_arch(pid), to_array_record(state))
        return out or super().models_to_evaluate(arrays)
