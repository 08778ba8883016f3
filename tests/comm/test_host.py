"""Host identity (spmd.comm.host): ranks are "on one host" only when shared memory can work between them."""

from __future__ import annotations

import os
import socket

import pytest

from spmd.comm import host


def test_the_identity_names_the_hostname_kernel_shm_mount_and_namespaces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPMD_HOST_ID", raising=False)
    shm = os.stat("/dev/shm")
    identity = host.host_identity()
    assert identity.startswith(socket.gethostname() + "/")
    assert f"shm={shm.st_dev}:{shm.st_ino}" in identity
    assert f"net={os.stat('/proc/self/ns/net').st_ino}" in identity
    assert f"pid={os.stat('/proc/self/ns/pid').st_ino}" in identity
    with open("/proc/sys/kernel/random/boot_id") as boot:
        assert boot.read().strip() in identity
    assert host.host_identity() == identity             # stable within a process


def test_spmd_host_id_is_taken_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPMD_HOST_ID", "rack7:slot3 not-a-hostname")   # a label: never resolved
    assert host.host_identity() == "rack7:slot3 not-a-hostname"


def test_without_a_usable_dev_shm_every_process_is_a_host_of_its_own(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path) -> None:
    monkeypatch.delenv("SPMD_HOST_ID", raising=False)
    monkeypatch.setattr(host, "SHM_DIR", str(tmp_path / "missing"))
    first, second = host.host_identity(), host.host_identity()
    assert first != second and "/no-shm/" in first
