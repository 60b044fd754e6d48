"""Launchers by name and the Ray launcher's settings, refused before anything starts (the Ray
launcher itself runs in tests/cli/test_ray_launch.py)."""

from __future__ import annotations

import pytest

from flowkit.runtime import Controller, LaunchError, LocalExecutors, RaySettings, make_launcher
from flowkit.runtime.raylaunch import RayExecutors, check_address


def test_launchers_are_picked_by_name_with_their_settings():
    with Controller() as ctl:
        local = make_launcher("local", ctl, 2, kind="base", tags=[()] * 2)
        ray = make_launcher("ray", ctl, 2, kind="torch", tags=[("train",)] * 2, device="cuda",
                            settings=RaySettings(strategy="SPREAD", cpus=0.5))
        assert isinstance(local, LocalExecutors) and isinstance(ray, RayExecutors)
        assert ray.bundles() == [{"GPU": 1.0}, {"GPU": 1.0}]
        assert make_launcher("ray", ctl, 1, kind="base", tags=[()],
                             settings=RaySettings(cpus=0.5)).bundles() == [{"CPU": 0.5}]
        with pytest.raises(ValueError, match="no launcher 'slurm': choose one of local, ray"):
            make_launcher("slurm", ctl, 1, kind="base", tags=[()])
        with pytest.raises(ValueError, match="the local launcher takes no settings"):
            make_launcher("local", ctl, 1, kind="base", tags=[()], settings=RaySettings())


def test_ray_settings_are_checked_when_made():
    with pytest.raises(ValueError, match="'strategy' must be in"):
        RaySettings(strategy="STRICT")
    with pytest.raises(ValueError, match="'cpus' must be > 0"):
        RaySettings(cpus=0)


def test_a_ray_address_must_be_host_and_port():
    with pytest.raises(LaunchError, match="is not HOST:PORT, ray://HOST:PORT or auto"):
        check_address("head-node")
    check_address("auto")  # Ray's to resolve
    check_address(None)
