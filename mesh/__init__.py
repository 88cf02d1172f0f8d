"""Device pool and worker geometry (aligned CP submeshes).

Public API: `worker_mesh(devices, first_device, cp_degree, axis="cp") -> jax.sharding.Mesh`.
"""

from __future__ import annotations

from mesh.submesh import worker_mesh

__all__ = ["worker_mesh"]
