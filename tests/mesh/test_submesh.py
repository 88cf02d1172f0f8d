"""worker_mesh: aligned, power-of-two device groups carved from the host's devices."""

from __future__ import annotations

import jax
import pytest

from mesh import worker_mesh


@pytest.mark.parametrize("first,cp", [(0, 1), (5, 1), (2, 2), (4, 4), (0, 8)])
def test_worker_mesh_devices_and_axis(first, cp):
    devices = jax.devices()
    mesh = worker_mesh(devices, first, cp)
    assert mesh.axis_names == ("cp",) and mesh.shape["cp"] == cp
    assert [d.id for d in mesh.devices.reshape(-1)] == [devices[i].id
                                                        for i in range(first, first + cp)]


@pytest.mark.parametrize("first,cp,match", [
    (0, 3, "power of two"), (0, 0, "power of two"), (2, 4, "multiple of cp_degree"),
    (-2, 2, "multiple of cp_degree"), (8, 1, "run past"), (4, 8, "multiple"),
])
def test_worker_mesh_rejects_bad_groups(first, cp, match):
    with pytest.raises(ValueError, match=match):
        worker_mesh(jax.devices(), first, cp)
