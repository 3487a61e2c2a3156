"""Deployed, the paths a `flwr run` user names stay inside the operator's roots (server_app/paths.py)."""

from __future__ import annotations

import os

import pytest

from server_app.paths import ROOTS_VARIABLE, allowed_roots, confine
from ssl_models.config import ConfigError


def test_default_roots_are_the_app_and_outputs(tmp_path, monkeypatch):
    monkeypatch.delenv(ROOTS_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    assert allowed_roots(tmp_path / "app") == [(tmp_path / "app").resolve(), (tmp_path / "outputs").resolve()]


def test_operator_roots_replace_outputs_and_keep_the_app(tmp_path, monkeypatch):
    monkeypatch.setenv(ROOTS_VARIABLE, os.pathsep.join([str(tmp_path / "data"), str(tmp_path / "res")]))
    assert allowed_roots(tmp_path / "app") == [(tmp_path / p).resolve() for p in ("app", "data", "res")]


def test_a_path_outside_the_roots_is_refused_naming_key_path_and_roots(tmp_path):
    roots = [tmp_path / "data"]
    (tmp_path / "data").mkdir()
    assert confine(tmp_path / "data" / "x.npz", "data.path", roots) == tmp_path / "data" / "x.npz"
    with pytest.raises(
        ConfigError,
        match=r"data.path: '/etc/passwd' resolves to /etc/passwd, outside the folders .*"
        rf"{ROOTS_VARIABLE}",
    ):
        confine("/etc/passwd", "data.path", roots)
    # ".." and symbolic links do not lead out.
    with pytest.raises(ConfigError, match=r"^output-dir: "):
        confine(tmp_path / "data" / ".." / "elsewhere", "output-dir", roots)
    (tmp_path / "data" / "link").symlink_to("/etc")
    with pytest.raises(ConfigError, match=r"^config: .* resolves to /etc/passwd"):
        confine(tmp_path / "data" / "link" / "passwd", "config", roots)


def test_a_deployed_run_with_a_config_outside_the_roots_stops_before_reading_it(tmp_path, monkeypatch):
    """The ServerApp, given a grid that is not the simulation's, confines the config path before it opens it."""
    from flwr.app import Context, RecordDict

    import server_app.app as server_module

    secret = tmp_path / "secret" / "cfg.yaml"
    secret.parent.mkdir()
    secret.write_text("name: [unterminated\n")  # its content would show in a YAML error if it were read
    monkeypatch.setenv(ROOTS_VARIABLE, str(tmp_path / "allowed"))

    class DeployedGrid:
        def get_node_ids(self):
            return []

    with pytest.raises(ConfigError, match=r"^config: .*secret/cfg.yaml.* outside the folders"):
        server_module.main(
            DeployedGrid(),
            Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={"config": str(secret)}),
        )
    with pytest.raises(ConfigError, match=r"^data.path: '/etc' .* outside the folders"):
        server_module.main(
            DeployedGrid(),
            Context(
                run_id=1,
                node_id=0,
                node_config={},
                state=RecordDict(),
                run_config={"config": "configs/smoke.yaml", "data.path": "/etc"},
            ),
        )
