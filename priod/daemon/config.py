"""Configuration: defaults < TOML file < ``PRIOD_<SECTION>__<KEY>`` environment < command line.

Everything is validated at start into frozen dataclasses; a bad value fails fast with an error
that names the setting and the fix. config/priod.toml documents every setting.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_type_hints

from priod.common.gpus import uuid_key
from priod.common.socket_path import default_socket_path
from priod.daemon.engines.sim import SimSettings
from priod.daemon.sched.policy import (
    DEFAULT_CLASSES,
    ClassSpec,
    Policy,
    SchedulerSettings,
    Tuning,
    validate_policy,
)
from priod.errors import ConfigError, InvalidRequest

__all__ = ["Config", "load_config"]

MAX_CONFIG_BYTES = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    socket: str = ""
    """Empty: the default path (see `default_socket_path`)."""
    backend: Literal["auto", "sim", "cuda"] = "auto"
    socket_mode: int = 0o660
    max_frame_bytes: int = 1 << 20
    max_output_bytes: int = 4 << 20
    max_clients: int = 256
    bulk_poll: Literal["spin", "timer"] = "timer"
    """How the daemon waits for a non-urgent chunk due within 2 ms on an engine that is polled
    (cuda): "timer" sleeps until it is due, on a timerfd the event loop watches (little CPU),
    "spin" polls every loop turn (about one core while bulk moves, for a little less urgent
    latency)."""
    urgent_poll: Literal["spin", "timer"] = "timer"
    """How the daemon waits while urgent work is recent (``[tuning] urgent_window_ms``) on an
    engine that is polled: "spin" turns the loop every time (a chunk's end and the next request
    are seen at once, at the cost of a core); "timer" sleeps until the next chunk is due (polling
    every turn only within `URGENT_SPIN_WITHIN_S` of it) and until a request or a direct copy's
    hold doorbell wakes it."""
    allow_uids: tuple[int, ...] = ()
    allow_gids: tuple[int, ...] = ()
    hello_timeout_s: float = 5.0
    """A connection that has not sent its hello this long after connecting is closed."""
    idle_timeout_s: float = 600.0
    """A connection with no regions and no copies pending that sends nothing this long is
    closed. 0: never."""


@dataclass(frozen=True)
class LimitsConfig:
    max_pinned_bytes: int = 16 << 30
    max_device_bytes: int = 64 << 30
    max_regions: int = 1024
    max_queued_requests: int = 4096
    max_queued_bytes: int = 64 << 30
    max_queued_segments: int = 1 << 20
    """Segments of pending batches (copy_batch): about 32 bytes of daemon memory each."""
    max_event_wait_s: float = 60.0
    """Seconds a copy may be held for its ``wait_event`` before the daemon cancels it (an event
    never recorded complete would hold it, and its place in the limits, forever). 0: no limit."""
    # Per uid, over all its connections (uid 0 and the daemon's own uid included, except for
    # the connection count).
    max_connections_per_uid: int = 64
    max_pinned_bytes_per_uid: int = 64 << 30
    max_device_bytes_per_uid: int = 256 << 30
    max_regions_per_uid: int = 4096
    max_queued_requests_per_uid: int = 16384
    max_queued_bytes_per_uid: int = 256 << 30
    max_requests_per_s_per_uid: float = 10_000.0
    """Requests (of any kind) a uid's connections may send per second together; past it priod
    reads them more slowly (nothing is refused). 0: no cap."""
    request_burst_per_uid: int = 2_000
    request_loop_share: float = 0.1
    """Share of the daemon's event-loop time that the requests of all uids together may take
    while two or more uids send them; each uid gets an equal part, and a uid past its part waits
    (its connections are read later; rate.py `LoopShare`). uid 0 and the daemon's own uid are
    charged but never wait. 0: no bound."""
    max_queued_segments_per_uid: int = 4 << 20
    # The whole daemon. 0: derived (see config/priod.toml).
    max_pinned_total_bytes: int = 0
    max_device_total_bytes: int = 0
    max_regions_total: int = 0
    max_shares_per_region: int = 64


@dataclass(frozen=True)
class CudaConfig:
    devices: tuple[int, ...] = ()
    """Empty: every visible GPU."""
    calibrate_bytes: int = 256 << 20


@dataclass(frozen=True)
class MetricsConfig:
    address: str = "127.0.0.1"
    port: int = 0
    """0: no metrics endpoint."""


@dataclass(frozen=True)
class ServiceConfig:
    shutdown: Literal["finish", "cancel"] = "finish"
    shutdown_timeout_s: float = 10.0


@dataclass(frozen=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


@dataclass(frozen=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    tuning: Tuning = field(default_factory=Tuning)
    """Internal constants, not in the shipped config (docs/design.md, "Defaults and why")."""
    classes: tuple[ClassSpec, ...] = DEFAULT_CLASSES
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    sim: SimSettings = field(default_factory=SimSettings)
    cuda: CudaConfig = field(default_factory=CudaConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    log: LogConfig = field(default_factory=LogConfig)
    source: str = "defaults"
    moved: tuple[str, ...] = ()
    """Settings found under an old name, each as "[old] key -> [new] key": the daemon logs them."""

    @property
    def socket_path(self) -> str:
        return self.server.socket or default_socket_path()

    def policy(self) -> Policy:
        """What the scheduler runs on: ``[scheduler]``, ``[tuning]`` and ``[classes]`` (validated at load)."""
        return self.scheduler.with_classes(self.classes, self.tuning)

    def replace(self, **sections: Any) -> Config:
        """A copy with some settings changed: ``cfg.replace(scheduler={"mode": "fifo"})``."""
        raw = _as_raw(self)
        for name, values in sections.items():
            if name == "classes" or not isinstance(values, Mapping):
                raw[name] = values
                continue
            if name == "scheduler":  # an old spelling of a [tuning] key replaces it there
                raw["tuning"].update({k: v for k, v in values.items() if k in _TUNING_KEYS})
                values = {k: v for k, v in values.items() if k not in _TUNING_KEYS}
            raw.setdefault(name, {}).update(values)
        return _build(raw, self.source)


_SECTIONS = {f.name: f for f in dataclasses.fields(Config) if f.name not in ("classes", "source", "moved")}

_TUNING_KEYS = frozenset(f.name for f in dataclasses.fields(Tuning))
"""Keys that ``[scheduler]`` held before they moved to ``[tuning]``: still read there."""


def load_config(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (if given), apply ``PRIOD_<SECTION>__<KEY>`` overrides, validate."""
    env = os.environ if environ is None else environ
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        try:
            with p.open("rb") as fp:
                data = fp.read(MAX_CONFIG_BYTES + 1)
        except OSError as exc:
            raise ConfigError(
                f"cannot read config file {p}: {exc.strerror}; pass an existing file with --config"
            ) from exc
        if len(data) > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {p} is over {MAX_CONFIG_BYTES} bytes; is it the right file?")
        try:
            raw = tomllib.loads(data.decode())
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from exc
        source = str(p)
    for key, value in env.items():
        if key.startswith("PRIOD_") and "__" in key:
            parts = [s.lower() for s in key[len("PRIOD_") :].split("__")]
            node = raw
            for part in parts[:-1]:
                nxt = node.setdefault(part, {})
                if not isinstance(nxt, dict):
                    raise ConfigError(f"environment {key} names a setting inside [{part}], which is not a table")
                node = nxt
            node[parts[-1]] = _parse_env_value(value)
    return _build(raw, source)


def _parse_env_value(text: str) -> Any:
    """Environment values are TOML values (``500``, ``true``, ``[1000, 1001]``), else plain strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def _move_tuning_keys(raw: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``raw`` with any ``[scheduler]`` tuning key moved to ``[tuning]``, and what moved."""
    scheduler = raw.get("scheduler")
    if not isinstance(scheduler, Mapping) or not _TUNING_KEYS & set(scheduler):
        return dict(raw), ()
    out = dict(raw)
    tuning = dict(out.get("tuning") or {})
    kept: dict[str, Any] = {}
    moved = []
    for key, value in scheduler.items():
        if key not in _TUNING_KEYS:
            kept[key] = value
            continue
        if key in tuning:
            raise ConfigError(
                f"[scheduler] {key} and [tuning] {key} are both set; {key} is a [tuning] setting now: remove it from [scheduler]"
            )
        tuning[key] = value
        moved.append(f"[scheduler] {key} -> [tuning] {key}")
    out["scheduler"], out["tuning"] = kept, tuning
    return out, tuple(moved)


def _build(raw: Mapping[str, Any], source: str) -> Config:
    raw, moved = _move_tuning_keys(raw)
    unknown = set(raw) - set(_SECTIONS) - {"classes"}
    if unknown:
        raise ConfigError(f"unknown config section(s) {sorted(unknown)}; known: {sorted([*_SECTIONS, 'classes'])}")
    sections: dict[str, Any] = {}
    for name, f in _SECTIONS.items():
        section_raw = raw.get(name, {})
        if not isinstance(section_raw, Mapping):
            raise ConfigError(f"[{name}] must be a table")
        assert callable(f.default_factory)
        sections[name] = _section(name, f.default_factory(), section_raw)
    classes = _classes(raw.get("classes")) if "classes" in raw else DEFAULT_CLASSES
    cfg = Config(**sections, classes=classes, source=source, moved=moved)
    _validate(cfg)
    return cfg


def _section(name: str, default: Any, values: Mapping[str, Any]) -> Any:
    hints = get_type_hints(type(default))
    known = {f.name for f in dataclasses.fields(default)}
    unknown = set(values) - known
    if unknown:
        raise ConfigError(f"unknown setting(s) {sorted(unknown)} in [{name}]; known: {sorted(known)}")
    out = {}
    for key, value in values.items():
        out[key] = _coerce(f"[{name}] {key}", hints[key], value)
    return dataclasses.replace(default, **out)


def _coerce(where: str, hint: Any, value: Any) -> Any:
    choices = get_args(hint) if getattr(hint, "__origin__", None) is Literal else ()
    if choices:
        if value not in choices:
            raise ConfigError(f"{where} = {value!r} is invalid; set it to one of {', '.join(repr(c) for c in choices)}")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} must be true or false")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} = {value!r} must be a whole number")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} = {value!r} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} = {value!r} must be a string")
        return value
    if getattr(hint, "__origin__", None) is tuple and get_args(hint)[0] is str:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f'{where} = {value!r} must be a list of strings, like ["GPU-...", "GPU-..."]')
        return tuple(value)
    if getattr(hint, "__origin__", None) is tuple:
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where} = {value!r} must be a list of whole numbers, like [1000, 1001]")
        return tuple(value)
    raise ConfigError(f"{where}: unsupported setting type {hint}")  # pragma: no cover - a bug here


def _classes(raw: Any) -> tuple[ClassSpec, ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError("[classes] must be a table of classes, like [classes.urgent] strict = true")
    out = []
    for name, spec in raw.items():
        if not isinstance(spec, Mapping):
            raise ConfigError(f"[classes.{name}] must be a table with 'weight' and optionally 'strict', 'uids', 'gids'")
        unknown = set(spec) - {"weight", "strict", "uids", "gids"}
        if unknown:
            raise ConfigError(
                f"unknown setting(s) {sorted(unknown)} in [classes.{name}]; known: ['gids', 'strict', 'uids', 'weight']"
            )
        weight = _coerce(f"[classes.{name}] weight", int, spec.get("weight", 1))
        strict = _coerce(f"[classes.{name}] strict", bool, spec.get("strict", False))
        uids = _coerce(f"[classes.{name}] uids", tuple[int, ...], spec.get("uids", []))
        gids = _coerce(f"[classes.{name}] gids", tuple[int, ...], spec.get("gids", []))
        out.append(ClassSpec(name, weight, strict, uids, gids))
    return tuple(out)


def _validate(cfg: Config) -> None:
    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    validate_policy(cfg.policy())  # [scheduler] and [classes]: checked where the scheduler checks them
    sv = cfg.server
    need(
        1024 <= sv.max_frame_bytes <= 64 << 20,
        f"[server] max_frame_bytes = {sv.max_frame_bytes} is invalid; set 1024 <= max_frame_bytes <= 67108864",
    )
    need(sv.max_output_bytes >= sv.max_frame_bytes, "[server] max_output_bytes must be >= max_frame_bytes")
    need(
        0 <= sv.socket_mode <= 0o777,
        f"[server] socket_mode = {sv.socket_mode:o} is invalid; use an octal mode like 0o660",
    )
    need(sv.max_clients >= 1, "[server] max_clients must be >= 1")
    need(
        0 < sv.hello_timeout_s < float("inf"),
        f"[server] hello_timeout_s = {sv.hello_timeout_s} is invalid; set a finite number of seconds > 0",
    )
    need(
        0 <= sv.idle_timeout_s < float("inf"),
        f"[server] idle_timeout_s = {sv.idle_timeout_s} is invalid; set a finite number of seconds >= 0 (0: never)",
    )
    lim = cfg.limits
    for name in (
        "max_pinned_bytes",
        "max_device_bytes",
        "max_regions",
        "max_queued_requests",
        "max_queued_bytes",
        "max_queued_segments",
    ):
        need(getattr(lim, name) >= 1, f"[limits] {name} must be >= 1")
    per_uid = (
        "max_connections_per_uid",
        "max_pinned_bytes_per_uid",
        "max_device_bytes_per_uid",
        "max_regions_per_uid",
        "max_queued_requests_per_uid",
    )
    for name in (*per_uid, "max_queued_bytes_per_uid", "max_queued_segments_per_uid"):
        need(getattr(lim, name) >= 1, f"[limits] {name} must be >= 1")
    need(
        0 <= lim.max_requests_per_s_per_uid < float("inf"),
        f"[limits] max_requests_per_s_per_uid = {lim.max_requests_per_s_per_uid} is invalid; set a finite number >= 0 (0: no cap)",
    )
    need(
        lim.request_burst_per_uid >= 1,
        f"[limits] request_burst_per_uid = {lim.request_burst_per_uid} is invalid; set request_burst_per_uid >= 1",
    )
    need(
        0 <= lim.request_loop_share <= 1,
        f"[limits] request_loop_share = {lim.request_loop_share} is invalid; set 0 <= request_loop_share <= 1 (of the daemon's loop time; 0: no bound)",
    )
    need(
        0 <= lim.max_event_wait_s < float("inf"),
        f"[limits] max_event_wait_s = {lim.max_event_wait_s} is invalid; set a finite number of seconds >= 0 (0: no limit)",
    )
    for name in ("max_pinned_total_bytes", "max_device_total_bytes", "max_regions_total", "max_shares_per_region"):
        need(getattr(lim, name) >= 0, f"[limits] {name} must be >= 0")
    sim = cfg.sim
    need(sim.devices >= 1, f"[sim] devices = {sim.devices} is invalid; set devices >= 1")
    for name in ("h2d_gbps", "d2h_gbps", "d2d_gbps", "peer_gbps"):
        need(getattr(sim, name) > 0, f"[sim] {name} must be > 0 (GB/s)")
    need(
        0 <= sim.host_gbps < float("inf"),
        f"[sim] host_gbps = {sim.host_gbps} is invalid; set a finite number of GB/s >= 0 (0: no shared host-memory cap)",
    )
    need(
        0 < sim.express_share <= 1, f"[sim] express_share = {sim.express_share} is invalid; set 0 < express_share <= 1"
    )
    need(
        0 <= sim.cotenant_stall_us < float("inf"),
        f"[sim] cotenant_stall_us = {sim.cotenant_stall_us} is invalid; set cotenant_stall_us to a finite number >= 0 (microseconds; 0: no co-tenant computes)",
    )
    for name in ("context_slice_us", "context_switch_us"):
        value = getattr(sim, name)
        need(0 <= value < float("inf"), f"[sim] {name} = {value} is invalid; set a finite number of microseconds >= 0")
    _validate_sim_uuids(sim)
    need(0 <= cfg.metrics.port <= 65535, f"[metrics] port = {cfg.metrics.port} is invalid; 0 turns metrics off")
    need(cfg.service.shutdown_timeout_s > 0, "[service] shutdown_timeout_s must be > 0")


def _validate_sim_uuids(sim: SimSettings) -> None:
    if not sim.uuids:
        return
    if len(sim.uuids) != sim.devices:
        raise ConfigError(
            f"[sim] uuids lists {len(sim.uuids)} UUIDs for devices = {sim.devices}; give one per device, or leave it empty"
        )
    keys = []
    for text in sim.uuids:
        try:
            keys.append(uuid_key(text))
        except InvalidRequest as exc:
            raise ConfigError(f"[sim] uuids: {exc}") from exc
    if len(set(keys)) != len(keys):
        raise ConfigError(f"[sim] uuids = {list(sim.uuids)} names one GPU twice; give each device its own UUID")


def _as_raw(cfg: Config) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for name in _SECTIONS:
        raw[name] = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(getattr(cfg, name)).items()
        }
    raw["classes"] = {
        c.name: {"weight": c.weight, "strict": c.strict, "uids": list(c.uids), "gids": list(c.gids)}
        for c in cfg.classes
    }
    return raw
