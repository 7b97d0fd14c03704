"""Configuration: TOML, environment overrides, and errors that name the setting and the fix."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from priod.common.socket_path import default_socket_path
from priod.daemon.config import load_config
from priod.daemon.sched.policy import Tuning
from priod.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_shipped_config_loads_and_matches_defaults() -> None:
    """config/priod.toml is valid and documents the built-in defaults (same values)."""
    shipped = load_config(REPO / "config" / "priod.toml", environ={})
    defaults = load_config(None, environ={})
    assert shipped.scheduler == defaults.scheduler
    assert shipped.classes == defaults.classes
    assert shipped.limits == defaults.limits
    assert shipped.sim == defaults.sim and shipped.tuning == defaults.tuning


def test_shipped_config_lists_only_operator_settings() -> None:
    """The shipped file has no [tuning] or [sim] table and none of the tuning keys: an operator
    sees what is theirs to decide."""
    raw = tomllib.loads((REPO / "config" / "priod.toml").read_text())
    assert "tuning" not in raw and "sim" not in raw
    tuning_keys = {f.name for f in dataclasses.fields(Tuning)}
    assert not tuning_keys & set(raw["scheduler"]), sorted(tuning_keys & set(raw["scheduler"]))


def test_tuning_keys_under_scheduler_are_read_and_named_as_moved(tmp_path: Path) -> None:
    """An old config with a tuning key under [scheduler] still loads, the value lands in
    [tuning], and `moved` names the move (the daemon logs it); setting both places is an error
    that says which to remove."""
    old = tmp_path / "old.toml"
    old.write_text("[scheduler]\nmax_block_us = 500.0\ndepth = 3\nexplore_every = 50\n")
    cfg = load_config(old, environ={})
    assert cfg.tuning.depth == 3 and cfg.tuning.explore_every == 50 and cfg.scheduler.max_block_us == 500.0
    assert cfg.policy().depth == 3
    assert cfg.moved == ("[scheduler] depth -> [tuning] depth", "[scheduler] explore_every -> [tuning] explore_every")
    env = load_config(None, environ={"PRIOD_SCHEDULER__DEPTH": "5"})
    assert env.tuning.depth == 5 and env.moved == ("[scheduler] depth -> [tuning] depth",)
    both = tmp_path / "both.toml"
    both.write_text("[scheduler]\ndepth = 3\n[tuning]\ndepth = 4\n")
    with pytest.raises(ConfigError, match=r"remove it from \[scheduler\]"):
        load_config(both, environ={})
    assert load_config(None, environ={}).moved == ()


def test_policy_is_scheduler_section_plus_classes() -> None:
    """cfg.policy() carries every [scheduler] setting and the classes; replace() re-validates."""
    cfg = load_config(None, environ={}).replace(scheduler={"max_block_us": 250, "depth": 4})
    policy = cfg.policy()
    assert (policy.mode, policy.max_block_us, policy.depth, policy.express) == ("priod", 250.0, 4, True)
    assert policy.classes == cfg.classes
    with pytest.raises(ConfigError, match=r"^\[tuning\] depth = 65 is invalid"):
        cfg.replace(scheduler={"depth": 65})


def test_environment_overrides_file(tmp_path: Path) -> None:
    """PRIOD_<SECTION>__<KEY> wins over the file; values parse as TOML."""
    f = tmp_path / "p.toml"
    f.write_text('[scheduler]\nmode = "priod"\nmax_block_us = 500\n')
    cfg = load_config(f, environ={"PRIOD_SCHEDULER__MODE": "fifo", "PRIOD_SERVER__ALLOW_UIDS": "[1000, 1001]"})
    assert cfg.scheduler.mode == "fifo"
    assert cfg.scheduler.max_block_us == 500.0
    assert cfg.server.allow_uids == (1000, 1001)


def test_classes_from_file(tmp_path: Path) -> None:
    """[classes] replaces the default set; strict and weights are read."""
    f = tmp_path / "p.toml"
    f.write_text("[classes.now]\nstrict = true\n[classes.later]\nweight = 3\n")
    cfg = load_config(f, environ={})
    assert [(c.name, c.weight, c.strict) for c in cfg.classes] == [("now", 1, True), ("later", 3, False)]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[scheduler]\nmode = "lifo"\n', r"^\[scheduler\] mode = 'lifo' is invalid; set it to one of 'priod', 'fifo'$"),
        ("[tuning]\ndepth = 0\n", r"^\[tuning\] depth = 0 is invalid; set 1 <= depth <= 64$"),
        (
            "[scheduler]\nmax_block_us = -1\n",
            r"^\[scheduler\] max_block_us = -1.0 is invalid; set it > 0 \(microseconds\)$",
        ),
        ("[scheduler]\nchunk = 5\n", r"^unknown setting\(s\) \['chunk'\] in \[scheduler\]; known: "),
        ("[sched]\nmode = 1\n", r"^unknown config section\(s\) \['sched'\]"),
        (
            '[limits]\nmax_queued_requests = "many"\n',
            r"^\[limits\] max_queued_requests = 'many' must be a whole number$",
        ),
        ("[classes.a]\nstrict = true\n", r"^\[classes\] needs at least one class without strict = true"),
        ("[classes.a]\nweight = 0\n", r"^\[classes.a\] weight = 0 is invalid; set weight >= 1$"),
        (
            "[tuning]\nmin_chunk_bytes = 1024\n",
            r"^\[tuning\] min_chunk_bytes = 1024 is invalid; set min_chunk_bytes >= 4096$",
        ),
        ("[scheduler]\naging_ms = 0\n", r"^\[scheduler\] aging_ms = 0.0 is invalid; set it > 0$"),
        (
            "[limits]\nrequest_loop_share = 1.5\n",
            r"^\[limits\] request_loop_share = 1.5 is invalid; set 0 <= request_loop_share <= 1 \(of the daemon's loop time; 0: no bound\)$",
        ),
        (
            "[limits]\nrequest_loop_share = -0.1\n",
            r"^\[limits\] request_loop_share = -0.1 is invalid; set 0 <= request_loop_share <= 1",
        ),
        ('[limits]\nrequest_loop_share = "half"\n', r"^\[limits\] request_loop_share = 'half' must be a number$"),
    ],
)
def test_bad_settings_name_the_setting_and_fix(tmp_path: Path, text: str, message: str) -> None:
    """Each invalid setting fails at load with a message naming it and what to set."""
    f = tmp_path / "p.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(f, environ={})


def test_not_toml(tmp_path: Path) -> None:
    """A file that is not TOML is refused with its path in the message."""
    f = tmp_path / "p.toml"
    f.write_text("this is = = not toml")
    with pytest.raises(ConfigError, match=r"^config file .*p.toml is not valid TOML"):
        load_config(f, environ={})


def test_missing_file(tmp_path: Path) -> None:
    """A missing config file says so and how to fix it."""
    with pytest.raises(
        ConfigError,
        match=r"^cannot read config file .*nope.toml: No such file or directory; pass an existing file with --config$",
    ):
        load_config(tmp_path / "nope.toml", environ={})


def test_socket_path_resolution() -> None:
    """$PRIOD_SOCKET, then $XDG_RUNTIME_DIR/priod.sock, then /run/priod/priod.sock."""
    assert default_socket_path({"PRIOD_SOCKET": "/x/s", "XDG_RUNTIME_DIR": "/r"}) == "/x/s"
    assert default_socket_path({"XDG_RUNTIME_DIR": "/r"}) == "/r/priod.sock"
    assert default_socket_path({}) == "/run/priod/priod.sock"
