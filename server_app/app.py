"""The ServerApp: load and validate the experiment, find the clients, run the strategy, evaluate,
write results. Training math lives in ``ssl_models``; aggregation in ``strategies``."""

from __future__ import annotations

import atexit
import time
from collections.abc import Mapping
from contextlib import contextmanager
from logging import ERROR, INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid, ServerApp

from fedssl_wire import (
    RunStopped,
    clear_run_stopped,
    code_mismatch_reason,
    from_array_record,
    mark_run_stopped,
    readable_reason,
    to_array_record,
)
from ssl_models.config import ConfigError, ExperimentConfig
from ssl_models.data.preflight import NOTHING_SCORED, CheckedData, check_experiment_data
from ssl_models.data.splits import eval_subset_seeds
from ssl_models.evaluation.checkpoint import save_encoder_checkpoint
from ssl_models.evaluation.protocol import evaluate_backbone
from ssl_models.factory import build_ssl_model, load_partial_state, split_state, state_to_numpy
from ssl_models.training import resolve_device
from strategies import get_strategy_class
from strategies.fedssl import ModelToEvaluate
from strategies.nodes import query_partitions
from strategies.replies import CodeMismatchStop

from .checkpoint import Checkpoint, load_latest_checkpoint, save_checkpoint
from .experiment import APP_DIR, DEFAULT_CONFIG, load_experiment, output_dir_for, resolve_config_path
from .paths import allowed_roots, confine
from .provenance import provenance
from .results import (
    ResultsWriter,
    client_device_summary,
    client_size_notes,
    devices_note,
    trained_client_sizes,
    unused_output_dir,
)

app = ServerApp()


class FederationMismatch(RuntimeError):
    """The running federation does not match the experiment's client count."""


def discover_clients(grid: Grid, cfg: ExperimentConfig, say) -> dict[int, int]:
    """Map partition id -> node id by asking every node (``query.info``); check the federation size."""
    n = cfg.federation.num_clients
    how = (
        f'set the federation size to match, e.g. `flwr run . --federation-config "num-supernodes={n}"` '
        f"in simulation, or start {n} SuperNodes with num-partitions={n}; or set federation.num_clients"
    )
    # In a simulation every node exists when the ServerApp starts: a shortfall will not heal, so say so at once.
    simulated = type(grid).__name__ == "InMemoryGrid"
    deadline = time.monotonic() + (min(5.0, cfg.federation.node_wait_s) if simulated else cfg.federation.node_wait_s)
    nodes: list[int] = []
    while True:
        nodes = sorted(grid.get_node_ids())
        if len(nodes) >= n or time.monotonic() > deadline:
            break
        say(f"waiting for clients: {len(nodes)}/{n} nodes connected")
        time.sleep(2.0)
    if len(nodes) != n:
        raise FederationMismatch(
            f"the experiment has federation.num_clients={n} but the federation has {len(nodes)} nodes: {how}"
        )
    clients: dict[int, int] = {}
    hosts: dict[str, int] = {}  # clients per host, to show where the federation runs
    # A node listed but not yet active (a SuperNode recreated a moment ago) is asked again within the node wait.
    wait_s = max(0.0, deadline - time.monotonic()) if simulated else cfg.federation.node_wait_s
    for info in query_partitions(grid, nodes, timeout=cfg.federation.round_timeout_s, unavailable_wait_s=wait_s):
        if info.error:
            refusal = code_mismatch_reason(info.error)
            if refusal:
                raise CodeMismatchStop(f"node {info.node_id} runs other code than this ServerApp: {refusal}")
            raise RuntimeError(f"node {info.node_id} failed to report its partition: {info.error}")
        pid, num = info.partition_id, info.num_partitions
        if num != n:
            raise FederationMismatch(
                f"node {info.node_id} holds partition {pid} of {num}, but "
                f"the experiment has federation.num_clients={n}: {how}"
            )
        if pid in clients:
            raise FederationMismatch(f"two nodes claim partition-id {pid}: give every node its own partition-id")
        clients[pid] = info.node_id
        hosts[info.host or "?"] = hosts.get(info.host or "?", 0) + 1
    if sorted(clients) != list(range(n)):
        raise FederationMismatch(f"nodes reported partitions {sorted(clients)}, expected 0..{n - 1}: {how}")
    say(f"{n} clients found on {len(hosts)} host(s): " + ", ".join(f"{h} ({c})" for h, c in sorted(hosts.items())))
    return clients


class ServerEvaluator:
    """The fixed evaluation protocol on the server's labelled data (kNN monitor, final linear probe). ``enabled`` is
    false when there is none (unlabelled training images, no ``eval.path``): the run then scores nothing."""

    def __init__(self, cfg: ExperimentConfig, checked: CheckedData | None = None) -> None:
        self.cfg = cfg
        self.device = resolve_device(cfg.eval.device)
        checked = checked or check_experiment_data(cfg)
        self.enabled = checked.eval_data is not None
        data = checked.eval_data if checked.eval_data is not None else checked.data
        train_idx, test_idx = checked.eval_train_idx, checked.eval_test_idx
        self.x_train, self.y_train = data.x_train[train_idx], data.y_train[train_idx]
        self.x_test, self.y_test = data.x_test[test_idx], data.y_test[test_idx]
        self.num_classes = data.num_classes
        self.models: dict[tuple, torch.nn.Module] = {}  # one SSL model per (architecture, depth), reused
        self.depths: dict[str, int | None] = {}  # the depth of the latest model scored per architecture (grown ViTs)

    def load(self, model: ModelToEvaluate) -> torch.nn.Module:
        """The backbone of ``model`` (its architecture, at its depth for a grown ViT, rebuilt once; its state
        loaded)."""
        depth = {"depth": model.depth} if model.depth else {}
        self.depths[model.arch] = model.depth
        if (model.arch, model.depth) not in self.models:
            self.models[(model.arch, model.depth)] = build_ssl_model(
                self.cfg, seed=self.cfg.seed, arch=model.arch, **depth
            )
        ssl_model = self.models[(model.arch, model.depth)]
        load_partial_state(ssl_model, from_array_record(model.arrays))
        return ssl_model.backbone

    def protocol(self) -> dict[str, Any]:
        """What decides the scores besides the weights: written into every ``model.pt`` (``extra.eval_protocol``)
        so that ``fedssl-eval`` on the same data file reproduces the run's own numbers."""
        e = self.cfg.eval
        train_seed, test_seed = eval_subset_seeds(self.cfg)
        return {
            "knn_k": e.knn_k,
            "knn_temperature": e.knn_temperature,
            "probe_epochs": e.probe_epochs,
            "seed": self.cfg.seed,
            "max_train": e.max_train or None,
            "max_test": e.max_test or None,
            "train_subset_seed": train_seed,
            "test_subset_seed": test_seed,
            "data": self.cfg.eval.path or self.cfg.data.path or self.cfg.data.dataset,
        }

    def _score(self, backbone: torch.nn.Module, *, knn: bool, linear: bool) -> dict[str, Any]:
        e = self.cfg.eval
        return evaluate_backbone(
            backbone,
            self.x_train,
            self.y_train,
            self.x_test,
            self.y_test,
            self.num_classes,
            device=self.device,
            knn=knn,
            linear=linear,
            knn_k=e.knn_k,
            knn_temperature=e.knn_temperature,
            probe_epochs=e.probe_epochs,
            seed=self.cfg.seed,
        )

    def evaluate(self, model: ModelToEvaluate, *, knn: bool, linear: bool) -> dict[str, Any]:
        return self._score(self.load(model), knn=knn, linear=linear)

    def random_init(self, arch: str, *, linear: bool) -> dict[str, Any]:
        """The reference every score is read against: the run's own initial encoder of ``arch`` (seeded as the
        initial global model and every client's first model are), never trained, scored with the same protocol; a
        grown ViT at the depth of the latest model of ``arch`` scored."""
        depth = self.depths.get(arch)
        backbone = build_ssl_model(
            self.cfg, seed=self.cfg.seed, arch=arch, **({"depth": depth} if depth else {})
        ).backbone
        scores = self._score(backbone, knn=True, linear=linear)
        return {"knn_acc": scores["knn_acc"], "linear_probe_acc": scores["linear_probe_acc"]}

    def evaluate_models(
        self, models: dict[str, ModelToEvaluate], *, knn: bool, linear: bool
    ) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """Scores of one or several encoders. With several (Min-Local: every client's own), the headline
        scores are the minimum over them, and each model's scores are returned too."""
        by_model = {name: self.evaluate(model, knn=knn, linear=linear) for name, model in models.items()}
        if len(by_model) == 1:
            return next(iter(by_model.values())), {}
        headline = dict(next(iter(by_model.values())))
        for key in ("knn_acc", "linear_probe_acc"):
            values = [s[key] for s in by_model.values() if s.get(key) is not None]
            headline[key] = min(values) if values else None
            headline[f"{key}_mean"] = sum(values) / len(values) if values else None
        return headline, {name: {k: s.get(k) for k in ("knn_acc", "linear_probe_acc")} for name, s in by_model.items()}


@contextmanager
def stop_run(say, what: str, *errors: type[BaseException]):
    """Report an expected failure in one readable line (log and progress.log), then stop the run."""
    try:
        yield
    except errors as exc:
        log(ERROR, "%s: %s", what, exc)
        say(f"stopped: {what}: {exc}")
        owner = getattr(say, "__self__", None)  # ResultsWriter.progress: its reason is now written
        if owner is not None:
            owner.stopped = True
        raise


def stem_note(cfg: ExperimentConfig) -> str:
    """ ", ImageNet stem for 96 px images (model.stem auto)" where the run's ResNets have one, for the progress line."""
    archs = {cfg.client_arch(i) for i in range(cfg.federation.num_clients)} | {cfg.model.arch}
    if not any(a.startswith("resnet") for a in archs):
        return ""
    stem = cfg.resnet_stem()
    return f", {'CIFAR' if stem == 'cifar' else 'ImageNet'} stem for {cfg.image_side()} px images (model.stem {cfg.model.stem})"


def failed_note(record: dict) -> str:
    """ ", 1 failed (client 1: Node Unavailable ...)" for the progress line, or nothing."""
    failed = record.get("failed_clients") or []
    if not failed:
        return ""
    # a Ray out-of-memory reason, or a simulated ClientApp's traceback, runs to kilobytes: its own message only
    return (
        f", {len(failed)} failed ("
        + "; ".join(f"client {f['id']}: {readable_reason(f['reason'], 160)}" for f in failed)
        + ")"
    )


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _gain(score: float | None, reference: float | None) -> float | None:
    return None if score is None or reference is None else score - reference


def random_init_entries(
    scores: dict[str, Any],
    by_model: dict[str, dict[str, Any]],
    model_archs: dict[str, str],
    reference: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """summary.json entries that read the scores against the random-init reference of each model's architecture:
    ``random_init`` (per architecture), the headline gains (with several models: the smallest gain over them, as
    the headline scores are the minimum) and each model's own gains (added to ``by_model`` in place)."""
    gains: dict[str, list[float]] = {"knn": [], "linear_probe": []}
    for name, arch in model_archs.items():
        own = by_model.get(name, scores)
        for key in gains:  # noqa: PLC0206 - the key names the score; the list is appended to below
            gain = _gain(own.get(f"{key}_acc"), reference[arch][f"{key}_acc"])
            if name in by_model:
                by_model[name][f"{key}_gain_over_random"] = gain
            if gain is not None:
                gains[key].append(gain)
    return {
        "random_init": reference,
        "linear_probe_gain_over_random": min(gains["linear_probe"]) if gains["linear_probe"] else None,
        "knn_gain_over_random": min(gains["knn"]) if gains["knn"] else None,
    }


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _points(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.2f} points"


def resume_experiment(resume: str) -> tuple[ExperimentConfig, Checkpoint]:
    """The config and newest complete checkpoint of the run in folder ``resume`` (``resume=<output-dir>``), checked
    to fit together."""
    folder = Path(resume).expanduser().resolve()
    if not folder.is_dir():
        raise ConfigError(f"resume: {resume!r} is not a folder (give the output folder of the run to continue)")
    checkpoint = load_latest_checkpoint(folder)
    cfg = ExperimentConfig.from_dict(checkpoint.meta["config"])
    cfg.check_files()
    check_checkpoint_fits(cfg, checkpoint.global_arrays)
    return cfg, checkpoint


def check_writable(folder: Path) -> None:
    """ConfigError naming ``output-dir`` unless ``folder`` can be made and written (a parent that is a file, a
    read-only disk, no permission): one line before anything starts, not a traceback from the first write."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"output-dir: cannot write to {folder} ({exc.strerror or exc}); give a folder this ServerApp can write"
        ) from None


def ignored_on_resume(run_config: Mapping[str, Any], cfg: ExperimentConfig, limit: int = 8) -> str:
    """What a resume leaves out of what it was given, in words: run-config keys, and a given ``config`` file's
    settings that differ from the run's own (a resumed run keeps its own config)."""
    keys = sorted(k for k, v in run_config.items() if v != "" and k not in ("resume", "config"))
    parts = [f"run-config keys {keys} ignored"] if keys else []
    if run_config.get("config", ""):
        try:
            given, _ = load_experiment({k: v for k, v in run_config.items() if k != "resume"})
        except (ConfigError, FileNotFoundError) as exc:
            parts.append(f"the given config ({run_config['config']}) ignored ({exc})")
        else:
            diffs = sorted(dotted_differences(given.to_dict(), cfg.to_dict()) - {"name", "output_dir", "data.path"})
            if diffs:
                shown = ", ".join(
                    f"{k} ({_dotted_get(given.to_dict(), k)!r}; the run's {_dotted_get(cfg.to_dict(), k)!r})"
                    for k in diffs[:limit]
                )
                more = f" and {len(diffs) - limit} more" if len(diffs) > limit else ""
                parts.append(f"the given config's {shown}{more} ignored")
    return "; " + "; ".join(parts) if parts else ""


def dotted_differences(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for key in set(a) | set(b):
        va, vb = a.get(key), b.get(key)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            out |= dotted_differences(va, vb, f"{prefix}{key}.")
        elif va != vb:
            out.add(prefix + key)
    return out


def _dotted_get(tree: Mapping[str, Any], key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, Mapping) else None
    return tree


def check_checkpoint_fits(cfg: ExperimentConfig, global_arrays: Mapping[str, np.ndarray], limit: int = 3) -> None:
    """ConfigError unless every array of a checkpoint's global model has the name and shape the config's model
    gives it (a checkpoint written by other code, or edited): named shapes, before any client is asked."""
    if not global_arrays:
        return  # no global model (Hetero-SSFL): nothing to compare
    model = build_ssl_model(cfg, seed=cfg.seed)  # a layer-wise run's full-depth model holds every grown block
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    def fits(value, shape: tuple) -> bool:  # a scalar (BatchNorm's counter) may be stored as one element
        return tuple(np.shape(value)) == shape or (np.size(value) == 1 and int(np.prod(shape)) == 1)

    wrong = [
        f"{k} is {tuple(np.shape(v))} in the checkpoint, {shapes[k]} in the model"
        for k, v in global_arrays.items()
        if k in shapes and not fits(v, shapes[k])
    ]
    unknown = [k for k in global_arrays if k not in shapes]
    if wrong or unknown:
        details = wrong[:limit] + [f"{k} is not in the model" for k in unknown[:limit]]
        more = len(wrong) + len(unknown) - len(details)
        raise ConfigError(
            f"resume: the checkpoint's global model does not fit the model of its config "
            f"({cfg.method.name} on {cfg.model.arch}, width {cfg.model.width}): "
            + "; ".join(details)
            + (f"; and {more} more" if more > 0 else "")
            + " (written by other code, or edited?)"
        )


def register_stop_handler(handler) -> None:
    """Run ``handler`` when the ServerApp's process is ended: ``flwr stop`` signals the process that runs the
    ServerApp (in a simulation, in a thread of its own), and Flower's signal handler runs its registered exit
    handlers before it exits (a plain ``atexit`` hook would not run: the process is ended with ``os._exit`` while the
    ServerApp's thread is still busy). ``atexit`` too, for an interpreter that ends otherwise."""
    try:
        from flwr.supercore.exit import add_exit_handler
    except ImportError:  # another Flower layout: atexit alone
        pass
    else:
        add_exit_handler(handler, run_before_force_exit=True)
    atexit.register(handler)


@app.main()
def main(grid: Grid, context: Context) -> None:
    started = time.perf_counter()
    resume = str(context.run_config.get("resume", "") or "")
    checkpoint = None
    # Deployed, the paths a `flwr run` user names stay inside the operator's roots (server_app/paths.py); a local
    # simulation's user is its operator.
    roots = None if type(grid).__name__ == "InMemoryGrid" else allowed_roots(APP_DIR)
    try:
        if resume:
            if roots is not None:
                confine(resume, "resume", roots)
            cfg, checkpoint = resume_experiment(resume)
            config_path = Path(str(checkpoint.meta.get("config_file", "")))
        else:
            if roots is not None:
                confine(
                    resolve_config_path(str(context.run_config.get("config", "") or DEFAULT_CONFIG)), "config", roots
                )
            cfg, config_path = load_experiment(context.run_config)
        if roots is not None:
            for key, named in (
                ("data.path", cfg.data.path),
                ("eval.path", cfg.eval.path),
                ("model.init_weights", cfg.model.init_weights),
            ):
                if named:  # every file the ServerApp reads stays inside the operator's roots
                    confine(named, key, roots)
            if not resume:
                confine(output_dir_for(cfg), "output-dir", roots)
        # The data loads, splits and can be scored: checked before the output folder exists and any client trains.
        checked = check_experiment_data(cfg, log=lambda line: log(INFO, "%s", line))
    except (ConfigError, FileNotFoundError) as exc:
        log(ERROR, "Invalid experiment configuration: %s", exc)
        raise
    if checkpoint is not None:
        out_dir = Path(resume).expanduser().resolve()
        if checkpoint.round >= cfg.rounds and (out_dir / "summary.json").is_file():
            # Nothing left to do: say so and leave every file as it is (a new run with resume would rewrite them).
            log(
                INFO,
                "resume: the run in %s finished (round %d of %d, summary.json written): nothing to do, "
                "nothing changed; fedssl-eval scores its model.pt again, a new run trains longer",
                out_dir,
                checkpoint.round,
                cfg.rounds,
            )
            return
        writer = ResultsWriter(out_dir, resume_round=checkpoint.round, tensorboard=cfg.logging.tensorboard)
        say = writer.progress
        given = str(checkpoint.meta.get("config_file", ""))
        for damaged in checkpoint.damaged:  # a newer checkpoint that did not load: its rounds run again
            say(
                f"resume: a newer checkpoint is damaged and skipped ({damaged}); the rounds after round "
                f"{checkpoint.round} run again"
            )
        say(
            f"resuming {cfg.name!r} in {out_dir} after round {checkpoint.round} of {cfg.rounds} (checkpoint "
            f"{checkpoint.path.name}); the run's own config is used{ignored_on_resume(context.run_config, cfg)}"
        )
    else:
        wanted_dir = output_dir_for(cfg)
        out_dir = unused_output_dir(wanted_dir)
        try:
            check_writable(out_dir)
        except ConfigError as exc:
            log(ERROR, "Invalid experiment configuration: %s", exc)
            raise
        writer = ResultsWriter(out_dir, tensorboard=cfg.logging.tensorboard)
        say = writer.progress
        given = str(context.run_config.get("config", "") or DEFAULT_CONFIG)
        # Named as the user gave it: the app's own copy (under Flower's FLWR_HOME) means nothing to them.
        shown = given if Path(config_path).is_relative_to(APP_DIR) else str(config_path)
        say(f"experiment {cfg.name!r} from {shown}; results in {out_dir}")
        if out_dir != wanted_dir:
            say(f"{wanted_dir} already holds a run, which is never overwritten: writing to {out_dir} instead")
    state_root = out_dir / "client_state"
    clear_run_stopped(state_root)  # a resumed run: its clients may train again

    def on_exit() -> None:
        """The process ends before the run finished (``flwr stop`` ends a simulation's ServerApp through Flower's
        signal handler, a SIGTERM likewise): say so in the log and tell the clients to stop."""
        if writer.finished:
            return
        if not writer.stopped:
            say(
                f"stopped: the ServerApp ended after round {len(writer.records)} of {cfg.rounds} (flwr stop, or the "
                f"process was interrupted); resume with resume='{out_dir}'"
            )
            writer.stopped = True  # the ServerApp's own thread may still be in a round: it records nothing more
        mark_run_stopped(state_root, "the ServerApp ended before the run finished")

    register_stop_handler(on_exit)
    try:
        _run(grid, cfg, given, started, out_dir, writer, checked, run_id=context.run_id, checkpoint=checkpoint)
    except Exception as exc:
        if not writer.stopped:  # stop_run already wrote the reason of an expected failure
            say(f"stopped: {type(exc).__name__}: {exc}")
        writer.stopped = True
        mark_run_stopped(state_root, f"the ServerApp stopped: {type(exc).__name__}")
        raise
    except BaseException:  # SystemExit from Flower's signal handler (flwr stop), KeyboardInterrupt
        on_exit()
        raise
    finally:
        atexit.unregister(on_exit)  # (Flower's own list keeps it: on_exit does nothing once the run has finished)


def _run(
    grid: Grid,
    cfg: ExperimentConfig,
    config_given: str,
    started: float,
    out_dir,
    writer: ResultsWriter,
    checked: CheckedData,
    *,
    run_id: int,
    checkpoint: Checkpoint | None,
) -> None:
    say = writer.progress
    data, split = checked.data, checked.split  # loaded, split and checked before the output folder was made
    sizes = checked.client_sizes
    kind = f"{data.image_size} px, " + ("labelled" if data.labelled else "unlabelled")
    scored_on = (
        f"scored on {cfg.eval.path or 'its labelled splits'}"
        if checked.eval_data is not None
        else "nothing to score on"
    )
    say(
        f"data {cfg.data.dataset}: {len(data.x_train)} train images ({kind}); clients hold {sizes}; "
        f"server public split {len(split.public_idx)}; {scored_on}"
    )
    size_noted: set[int] = set()  # clients named for training on other data than the server's split gives them

    with stop_run(say, "the federation does not match the experiment", FederationMismatch):
        clients = discover_clients(grid, cfg, say)

    strategy_cls = get_strategy_class(cfg.strategy.name)
    strategy = strategy_cls(
        clients=clients,
        clients_per_round=cfg.clients_per_round,
        min_available=cfg.min_available_clients,
        node_wait_s=cfg.federation.node_wait_s,
        seed=cfg.seed,
        round_config=lambda rnd: {"lr": cfg.round_lr(rnd)},
        options=cfg.strategy.options,
        state_dir=str(out_dir / "client_state"),
    )
    strategy.prepare(cfg, data, split)
    # The clients' state folders are named after the run that started them (a resumed run keeps using them).
    state_run = str(checkpoint.meta["state_run"]) if checkpoint is not None else str(run_id)
    elapsed_before = float(checkpoint.meta.get("elapsed_s", 0.0)) if checkpoint is not None else 0.0
    strategy.state_run = state_run
    evaluator = ServerEvaluator(cfg, checked)
    initial_model = build_ssl_model(cfg, seed=cfg.seed)
    shared, _ = split_state(initial_model, strategy.exchange_prefixes(initial_model))
    initial = to_array_record(state_to_numpy(shared))
    first_round = 1
    if checkpoint is not None:
        strategy.restore_state(
            checkpoint.meta.get("strategy", {}),
            checkpoint.strategy_arrays,
            {name: str(checkpoint.store_snapshot(name)) for name in checkpoint.meta.get("stores", [])},
        )
        initial, first_round = to_array_record(checkpoint.global_arrays), checkpoint.round + 1
    say(
        f"{cfg.method.name} on {cfg.model.arch} (width {cfg.model.width}{stem_note(cfg)}), {cfg.strategy.name}, "
        f"{cfg.rounds} rounds, {strategy.clients_per_round}/{cfg.federation.num_clients} clients per round; "
        f"{strategy.traffic(initial.count_bytes())}"
    )

    def after_round(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Called by the strategy's round loop after every round: measure, record, checkpoint, report."""
        if writer.stopped:  # stopped from outside (flwr stop) while the round ran: record nothing more
            raise RunStopped(f"the run was stopped during round {server_round}")
        if server_round == 0:
            return None
        record = dict(strategy.round_records.get(server_round, {"round": server_round}))
        record["wall_s"] = strategy.round_wall_s(server_round)
        e = cfg.eval
        if evaluator.enabled and e.knn_every and (server_round % e.knn_every == 0 or server_round == cfg.rounds):
            t0 = time.perf_counter()
            scores, by_model = evaluator.evaluate_models(strategy.models_to_evaluate(arrays), knn=True, linear=False)
            record["knn_acc"] = scores["knn_acc"]
            if by_model:
                record["knn_acc_by_model"] = {name: v["knn_acc"] for name, v in by_model.items()}
            record["eval_s"] = time.perf_counter() - t0
        clients_list = record.pop("clients", [])
        record["clients"] = clients_list  # keep per-client facts last: the line stays readable
        writer.write_round(record)
        every = cfg.checkpoint.every
        if every and (server_round % every == 0 or server_round == cfg.rounds):
            plain, arrays_state, stores = strategy.checkpoint_state()
            elapsed = elapsed_before + time.perf_counter() - started  # the whole run's time up to this checkpoint
            save_checkpoint(
                out_dir,
                server_round,
                {
                    "config": cfg.to_dict(),
                    "config_file": config_given,
                    "state_run": state_run,
                    "strategy": plain,
                    "stores": sorted(stores),
                    "elapsed_s": elapsed,
                },
                from_array_record(arrays),
                arrays_state,
                {k: Path(v) for k, v in stores.items()},
                keep=cfg.checkpoint.keep,
            )
        if cfg.strategy.name != "central":  # the central trainer's one client holds the union by design
            for line in client_size_notes(record.get("clients") or [], sizes, size_noted):
                say(line)
        knn = f" | knn {100 * record['knn_acc']:.2f}%" if record.get("knn_acc") is not None else ""
        say(
            f"round {server_round}/{cfg.rounds} | loss {record.get('train_loss', float('nan')):.4f}{knn} | "
            f"up {_mb(record.get('bytes_up', 0))} down {_mb(record.get('bytes_down', 0))} | "
            f"{record['wall_s']:.1f} s | {record.get('num_clients', 0)} clients ok{failed_note(record)}"
            f"{devices_note(record['clients'])}"
        )
        return MetricRecord({"knn_acc": float(record["knn_acc"])}) if record.get("knn_acc") is not None else None

    final = strategy.run_rounds(
        grid,
        initial,
        first_round=first_round,
        num_rounds=cfg.rounds,
        timeout=cfg.federation.round_timeout_s,
        train_config=ConfigRecord({"experiment": cfg.to_json()}),
        after_round=after_round,
    )

    models = strategy.models_to_evaluate(final)
    for name, model in models.items():  # model.pt, or model_client_<i>.pt for each client's own encoder
        path = writer.model_path if len(models) == 1 else writer.out_dir / f"model_{name}.pt"
        save_encoder_checkpoint(
            path,
            evaluator.load(model),
            model.arch,
            cfg.model.width,
            extra={
                "method": cfg.method.name,
                "strategy": cfg.strategy.name,
                "model": name,
                "rounds": len(writer.records),
                "experiment": cfg.name,
                "eval_protocol": evaluator.protocol(),
            },
        )
    reference_entries: dict[str, Any] = {}
    by_model: dict[str, dict[str, Any]] = {}
    if evaluator.enabled:
        say("final evaluation (kNN + linear probe) ...")
        scores, by_model = evaluator.evaluate_models(models, knn=True, linear=cfg.eval.linear_probe)
    else:
        say(f"nothing scored: {NOTHING_SCORED}")
        scores = {"knn_acc": None, "linear_probe_acc": None, "num_train": 0, "num_test": 0, "feature_dim": None}
    if evaluator.enabled and cfg.eval.random_init_reference:
        archs = sorted({model.arch for model in models.values()})
        say(f"random-init reference ({', '.join(archs)}, the run's initial weights, same protocol) ...")
        reference = {arch: evaluator.random_init(arch, linear=cfg.eval.linear_probe) for arch in archs}
        reference_entries = random_init_entries(
            scores, by_model, {name: model.arch for name, model in models.items()}, reference
        )
    this_process_s = time.perf_counter() - started  # one reading: run_s is exactly the time before plus this
    summary = {
        "name": cfg.name,
        "method": cfg.method.name,
        "strategy": cfg.strategy.name,
        "linear_probe_acc": scores.get("linear_probe_acc"),
        "knn_acc": scores.get("knn_acc"),
        **reference_entries,
        **(
            {
                "scores_by_model": by_model,
                "headline": "minimum over the models",
                "linear_probe_acc_mean": scores.get("linear_probe_acc_mean"),
                "knn_acc_mean": scores.get("knn_acc_mean"),
            }
            if by_model
            else {}
        ),
        **strategy.summary_extras(by_model),
        "final_train_loss": writer.records[-1].get("train_loss") if writer.records else None,
        **writer.totals(),
        **client_device_summary(writer.records),  # where the clients trained: a CPU run on a GPU machine shows
        # the whole run: the time up to the checkpoint a resume started from, and this process's
        "run_s": elapsed_before + this_process_s,
        "run_s_this_process": this_process_s,
        **({"resumed_after_round": checkpoint.round} if checkpoint is not None else {}),
        "eval": {
            "scored": evaluator.enabled,
            **({} if evaluator.enabled else {"reason": NOTHING_SCORED}),
            "num_train": scores["num_train"],
            "num_test": scores["num_test"],
            "feature_dim": scores["feature_dim"],
            "features": "backbone (global average pool)",
            "knn_k": cfg.eval.knn_k,
            "knn_temperature": cfg.eval.knn_temperature,
            "probe_epochs": cfg.eval.probe_epochs,
            "split": "train part -> fit, test part -> score",
            "protocol": evaluator.protocol(),
        },
        # what the clients trained on (a node may hold a data file of its own), and what the server's split gave them
        "data": {
            "train_images": len(data.x_train),
            "client_sizes": sizes if cfg.strategy.name == "central" else trained_client_sizes(writer.records, sizes),
            "client_sizes_server_split": sizes,
            "public_size": len(split.public_idx),
        },
        "output_dir": str(out_dir),
        "config_file": config_given,
        "config": cfg.to_dict(),
        "provenance": provenance(cfg.to_dict(), cfg.train.device),
    }
    writer.write_summary(summary)
    writer.finished = True
    if writer.tensorboard is not None:
        writer.tensorboard.close()
    writer.plot(f"{cfg.name}: {cfg.method.name} / {cfg.strategy.name}")
    headline = " (minimum over the clients' models)" if by_model else ""
    against = ""
    if reference_entries:
        rand = reference_entries["random_init"]
        rand_lp = ", ".join(_pct(v["linear_probe_acc"]) for v in rand.values())
        rand_knn = ", ".join(_pct(v["knn_acc"]) for v in rand.values())
        against = (
            f"; random init: linear probe {rand_lp}, kNN {rand_knn}; gain over random init: linear probe "
            f"{_points(summary['linear_probe_gain_over_random'])}, kNN {_points(summary['knn_gain_over_random'])}"
        )
    if not evaluator.enabled:
        say(f"done in {summary['run_s']:.1f} s: nothing scored: {NOTHING_SCORED}; results in {out_dir}")
        return
    say(
        f"done in {summary['run_s']:.1f} s: linear probe {_pct(summary['linear_probe_acc'])}, "
        f"kNN {_pct(summary['knn_acc'])}{headline}{against}; results in {out_dir}"
    )
