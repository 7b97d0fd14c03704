"""GPUs named by UUID end to end, on the sim engine with two devices.

Each process numbers the GPUs it sees from 0 (``CUDA_VISIBLE_DEVICES``, a container's GPU
assignment), so a client's ordinal means nothing to the daemon; the UUID is the same everywhere.
Here the daemon serves two sim GPUs with known UUIDs, and "pods" name one of them the way a CUDA
client does: by the UUID its own context reports for its own ordinal.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

import priod
from priod.common.gpus import format_uuid, sim_uuid, uuid_key
from priod.daemon.config import load_config
from priod.daemon.engines.sim import SimEngine, SimSettings
from priod.errors import ConfigError, InvalidRequest
from priod.testing import DaemonProcess, daemon_process
from priod.testing.fakes import ManualEngine
from priod.wire.messages import AllocDevice, RegionReply, RegisterDevice, decode_request

U0 = "GPU-0b5e5f4a-1c2d-4e3f-8a9b-0c1d2e3f4a5b"
U1 = "GPU-9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"
MiB = 1 << 20


@pytest.fixture(scope="module")
def two_gpus() -> Iterator[DaemonProcess]:
    """A sim daemon with two GPUs, U0 (its gpu0) and U1 (its gpu1), logging every copy."""
    env = {"PRIOD_SIM__DEVICES": "2", "PRIOD_SIM__UUIDS": json.dumps([U0, U1]), "PRIOD_LOG__LEVEL": '"debug"'}
    with daemon_process(env) as d:
        yield d
    assert d.proc.returncode == 0, d.log()[-4000:]


def _lane_bytes(st: dict[str, Any], lane: str) -> int:
    return int(st["lane_bytes"].get(lane, 0))


async def test_two_pods_with_different_visible_devices_reach_the_same_gpu_lane(two_gpus: DaemonProcess) -> None:
    """Pod A runs with CUDA_VISIBLE_DEVICES=U1 (its ordinal 0 is U1), pod B with U0,U1 (its
    ordinal 1 is U1). Each names the GPU by the UUID its own context reports; both regions land
    on the daemon's gpu1 and both pods' copies run on the lane gpu1/h2d, none on gpu0.

    By ordinal, pod A's "device 0" would have been the daemon's gpu0: the wrong GPU, the bug
    the UUID fixes (checked last, so the lane figures above are pods' UUID copies only)."""
    pod_a_visible = {0: U1}  # what cuDeviceGetUuid answers in pod A for each of its ordinals
    pod_b_visible = {0: U0, 1: U1}
    logged_before = len(two_gpus.log_records())
    async with (
        priod.connect(two_gpus.socket_path, name="pod-a", copy_path="daemon") as a,
        priod.connect(two_gpus.socket_path, name="pod-b", copy_path="daemon") as b,
    ):
        before = await a.status()
        regions = []
        for client, visible, ordinal, fill in ((a, pod_a_visible, 0, 0xA5), (b, pod_b_visible, 1, 0x5B)):
            dev = await client.alloc_device(2 * MiB, device=visible[ordinal])
            host = await client.alloc_host(2 * MiB)
            assert (dev.device, dev.device_uuid) == (1, U1)
            assert host.array is not None and dev.array is not None
            host.array[:] = fill
            r = await client.copy(dev, host, priority="urgent" if client is a else "bulk")
            assert r.nbytes == 2 * MiB
            assert int(dev.array.min()) == int(dev.array.max()) == fill
            regions.append(dev)
        after = await a.status()
        assert _lane_bytes(after, "gpu1/h2d") - _lane_bytes(before, "gpu1/h2d") == 4 * MiB
        assert _lane_bytes(after, "gpu0/h2d") == _lane_bytes(before, "gpu0/h2d")

        by_ordinal = await a.alloc_device(4096, device=0)
        assert (by_ordinal.device, by_ordinal.device_uuid) == (0, U0)
    copies = [line for line in two_gpus.log_records()[logged_before:] if line.get("event") == "copy"]
    assert len({c["conn"] for c in copies}) == 2
    assert [(c["lane"], c["gpu"]) for c in copies] == [("gpu1/h2d", U1)] * 2


async def test_uuid_wins_over_ordinal_and_takes_any_nvidia_smi_spelling(two_gpus: DaemonProcess) -> None:
    """A request with both fields goes by the UUID; upper case, and no ``GPU-`` prefix, name the
    same GPU (nvidia-smi prints lower case with the prefix; CUDA gives the bare bytes)."""
    async with priod.connect(two_gpus.socket_path, copy_path="daemon") as c:
        reply = await c.raw_request({"op": "alloc_device", "nbytes": 4096, "device": 0, "device_uuid": U1})
        assert (reply["device"], reply["device_uuid"]) == (1, U1)
        for spelling in (U1.upper(), U1[len("GPU-") :]):
            region = await c.alloc_device(4096, device=spelling)
            assert (region.device, region.device_uuid) == (1, U1)


async def test_unknown_or_malformed_uuid_is_refused_naming_the_served_gpus(two_gpus: DaemonProcess) -> None:
    """A UUID the daemon does not serve is refused with the GPUs it does serve and where to
    look; a malformed one shows the expected form. The connection stays usable."""
    stranger = "GPU-11111111-2222-4333-8444-555555555555"
    async with priod.connect(two_gpus.socket_path, copy_path="daemon") as c:
        with pytest.raises(
            InvalidRequest,
            match=rf"^this daemon serves no GPU {stranger}; it serves gpu0={U0}, gpu1={U1}\. Check .*nvidia-smi -L",
        ):
            await c.alloc_device(4096, device=stranger)
        with pytest.raises(
            InvalidRequest,
            match=r"^device 'gpu-1' names no GPU; give the daemon's ordinal as an int",
        ):
            await c.alloc_device(4096, device="gpu-1")
        await c.ping()


async def test_status_shows_each_gpu_and_each_lane_by_uuid(two_gpus: DaemonProcess) -> None:
    """``status`` lists the GPUs (ordinal and UUID), each lane names its GPU's UUID, and the
    engine figures carry them too; ``priod status`` prints them in its table."""
    async with priod.connect(two_gpus.socket_path, copy_path="daemon") as c:
        st = await c.status()
    assert st["gpus"] == [{"index": 0, "uuid": U0}, {"index": 1, "uuid": U1}]
    local = {f"gpu{i}/{d}": u for i, u in ((0, U0), (1, U1)) for d in ("d2d", "d2h", "h2d")}
    assert {ln["lane"]: ln["gpu"] for ln in st["lanes"]} == {**local, "gpu0/peer/gpu1": U0, "gpu1/peer/gpu0": U1}
    assert {ln["lane"]: ln["peer_gpu"] for ln in st["lanes"] if "peer_gpu" in ln} == {
        "gpu0/peer/gpu1": U1,
        "gpu1/peer/gpu0": U0,
    }
    assert st["engine"]["devices"] == st["gpus"]
    r = subprocess.run(
        [sys.executable, "-m", "priod", "status", "--socket", two_gpus.socket_path],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split() for line in lines[2:4]] == [["gpu0", U0], ["gpu1", U1]], r.stdout


def test_daemon_started_line_maps_ordinals_to_uuids(two_gpus: DaemonProcess) -> None:
    """The start line of the log says which UUID each ordinal (``gpu0`` in lane names) is."""
    started = [line for line in two_gpus.log_records() if line.get("event") == "daemon_started"]
    assert len(started) == 1 and started[0]["gpus"] == {"gpu0": U0, "gpu1": U1}


def test_register_device_carries_the_uuid_and_old_requests_still_decode() -> None:
    """The wire: both requests take an optional ``device_uuid``, checked at decode; requests
    without it (older clients) decode as before, by ordinal; the region reply names the UUID."""
    handle = bytes(64)
    new = decode_request(
        {"id": 1, "op": "register_device", "handle": handle, "nbytes": 8, "device": 2, "device_uuid": U1}
    )
    assert isinstance(new, RegisterDevice) and (new.device, new.device_uuid) == (2, U1)
    old = decode_request({"id": 2, "op": "alloc_device", "nbytes": 8, "device": 1})
    assert isinstance(old, AllocDevice) and (old.device, old.device_uuid) == (1, None)
    assert "device_uuid" not in AllocDevice(8, 1).encode(3)
    with pytest.raises(InvalidRequest, match=r"^field 'device_uuid' must be str, got int$"):
        decode_request({"id": 4, "op": "alloc_device", "nbytes": 8, "device_uuid": 7})
    with pytest.raises(InvalidRequest, match=r"^device_uuid 'GPU-xyz' is not a GPU UUID"):
        decode_request({"id": 5, "op": "register_device", "handle": handle, "nbytes": 8, "device_uuid": "GPU-xyz"})
    assert RegionReply.decode(RegionReply(1, 8, "device", 1, None, U1).encode(6)).device_uuid == U1
    assert "device_uuid" not in RegionReply(1, 8, "host").encode(7)


def test_uuid_format_matches_nvidia_smi() -> None:
    """16 raw bytes format as nvidia-smi prints them; `uuid_key` takes GPU-/MIG- prefixes and any case."""
    raw = bytes(range(16))
    assert format_uuid(raw) == "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f"
    assert (
        uuid_key("MIG-00010203-0405-0607-0809-0A0B0C0D0E0F")
        == uuid_key(format_uuid(raw))
        == "00010203-0405-0607-0809-0a0b0c0d0e0f"
    )
    with pytest.raises(ValueError, match=r"^a GPU UUID is 16 bytes, got 15$"):
        format_uuid(raw[:15])


def test_sim_uuids_are_stable_distinct_and_configurable() -> None:
    """Without [sim] uuids each device has a made-up UUID, the same every run and distinct per
    device; with it, the configured ones. The label helper falls back to ``gpuN`` for an engine
    without UUIDs (test fakes)."""
    engine = SimEngine(SimSettings(devices=3))
    try:
        assert engine.device_uuids() == {i: sim_uuid(i) for i in range(3)}
        assert len(set(engine.device_uuids().values())) == 3
        assert engine.device_uuid(2) == sim_uuid(2) and engine.device_ordinal(sim_uuid(1)) == 1
    finally:
        engine.close()
    assert sim_uuid(0) == "GPU-" + str(uuid.uuid5(uuid.UUID("6d1c2f4e-0b8a-4c55-9a49-2f0f5e1d7a11"), "priod-sim-gpu0"))
    configured = SimEngine(SimSettings(devices=2, uuids=(U0, U1)))
    try:
        assert configured.device_uuids() == {0: U0, 1: U1}
    finally:
        configured.close()
    manual = ManualEngine(devices=2)
    assert manual.device_uuid(1) == "gpu1"
    with pytest.raises(InvalidRequest, match=r"^this daemon serves no GPU .* it serves none with a UUID\."):
        manual.device_ordinal(U0)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"PRIOD_SIM__DEVICES": "2", "PRIOD_SIM__UUIDS": json.dumps([U0])},
            r"^\[sim\] uuids lists 1 UUIDs for devices = 2; give one per device, or leave it empty$",
        ),
        (
            {"PRIOD_SIM__DEVICES": "2", "PRIOD_SIM__UUIDS": json.dumps([U0, U0.upper()])},
            r"^\[sim\] uuids = .* names one GPU twice; give each device its own UUID$",
        ),
        ({"PRIOD_SIM__UUIDS": '["nope"]'}, r"^\[sim\] uuids: device_uuid 'nope' is not a GPU UUID"),
        ({"PRIOD_SIM__UUIDS": "[1]"}, r"^\[sim\] uuids = \[1\] must be a list of strings"),
    ],
)
def test_sim_uuids_config_is_validated(env: dict[str, str], message: str) -> None:
    """A wrong count, a duplicate, a malformed UUID or a non-string each stop the daemon at start with the fix."""
    with pytest.raises(ConfigError, match=message):
        load_config(environ=env)


def test_alloc_device_by_uuid_sends_only_the_uuid_field() -> None:
    """The client library turns a string ``device`` into ``device_uuid`` (an int stays the ordinal)."""
    from priod.client.base import alloc_device_request as _alloc_device_request

    assert _alloc_device_request(8, U1).encode(1) == {
        "id": 1,
        "op": "alloc_device",
        "nbytes": 8,
        "device": 0,
        "device_uuid": U1,
    }
    assert _alloc_device_request(8, 1).encode(2) == {"id": 2, "op": "alloc_device", "nbytes": 8, "device": 1}
